"""Where a start's first training step waits for data: the demo run, read from Ray's own task timeline.

    python -m bench.first_batch [--repeats 3] [--quick] [--set KEY=VALUE ...]

The first step of a start waits for its first batch (the ``first_step`` event's ``data_wait_s``; it counts on the
run's training clock). Each repeat runs the demo recipe as ``bench.unit_ab`` does (``--set`` changes config keys)
and, before Ray shuts down, reads ``ray.timeline()`` (Ray's public dump of its task events). Times are seconds
relative to the first step (negative: before it):

- ``request_s``: the first rank's request for its shard of the first phase (Ray Train's ``get_dataset_shard``);
- ``first_task_start_s`` / ``first_task_s``: the first map task of the phase (``train_block_batch``): its start
  and its length; ``request_to_first_task_s`` the gap between request and start: the stream's execution
  starting and a worker process being ready for the task;
- ``first_task_end_to_step_s``: from that task's end to the first step (the batch travelling to the rank);
- ``data_workers``: the worker processes that ran the phase's map tasks before the first step, and
  ``fresh_workers``: those of them with no event in the timeline before the request: none of the start-up's own
  tasks (the shard cache's decode, the calibration) ran in them, so their start and imports came with this stream
  (unless Ray had started them idle ahead, which the timeline cannot show).

Each run is ``bench.time_to_accuracy``'s lightray side (the demo recipe as shipped, a fresh local cluster). Each
figure is given over the repeats (median, min, max). Runs and their timelines
(``first-batch-<time>-<pid>-s<seed>.timeline.json``) go to ``--storage``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from bench.common import emit, load_avg, note, read_jsonl, spread
from bench.time_to_accuracy import DEFAULT_STORAGE, demo_tree, quick_overrides, run_lightray
from bench.unit_ab import parse_set

MAP_FN = "train_block_batch"  # the training map function (lightray.data.ingest): its tasks carry it in their name


def first_batch_parts(timeline: list[dict[str, Any]], first_step_t: float) -> dict[str, Any]:
    """The parts of the first step's wait found in a Chrome-trace ``timeline`` (``ray.timeline()``'s events: ``ts``
    and ``dur`` in microseconds since the epoch, ``tid`` the worker), the step taken at ``first_step_t`` (s)."""
    step_us = first_step_t * 1e6
    spans = [e for e in timeline if e.get("ph") == "X"]
    requests = sorted(e["ts"] for e in spans if e.get("name") == "get_dataset_shard" and e["ts"] <= step_us)
    if not requests:
        raise ValueError("the timeline has no get_dataset_shard call before the first step: expected Ray Train's "
                         "dataset manager to serve each rank's shard (did ray.train's internals change?)")
    request = requests[0]
    maps = sorted((e for e in spans if e.get("cat", "").startswith("task::") and MAP_FN in e.get("cat", "")
                   and request <= e["ts"] <= step_us), key=lambda e: e["ts"])
    if not maps:
        raise ValueError(f"the timeline has no {MAP_FN} map task between the shard request and the first step")
    first_seen: dict[str, float] = {}
    for e in timeline:
        if "ts" in e and "tid" in e:
            first_seen[e["tid"]] = min(first_seen.get(e["tid"], e["ts"]), e["ts"])
    workers = sorted({e["tid"] for e in maps})
    first = maps[0]

    def rel(us: float) -> float:
        return round((us - step_us) / 1e6, 3)

    return {"request_s": rel(request), "first_task_start_s": rel(first["ts"]),
            "first_task_s": round(first["dur"] / 1e6, 3),
            "request_to_first_task_s": round((first["ts"] - request) / 1e6, 3),
            "first_task_end_to_step_s": round((step_us - first["ts"] - first["dur"]) / 1e6, 3),
            "tasks_before_step": len(maps), "data_workers": len(workers),
            "fresh_workers": sum(first_seen[w] >= request for w in workers)}


def run_once(storage: str, overrides: dict[str, Any], seed: int) -> dict[str, Any]:
    """One demo run (the time-to-accuracy bench's ``run_lightray``), its timeline dumped before Ray shuts down."""
    import ray

    trace = os.path.join(storage, f"first-batch-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-s{seed}.timeline.json")
    run = run_lightray(storage, overrides, [0.8], seed, before_shutdown=lambda: ray.timeline(filename=trace))
    events = read_jsonl(os.path.join(run["run_dir"], "metrics.jsonl"))
    step = next((e for e in events if e.get("event") == "first_step"), None)
    if step is None:
        raise RuntimeError(f"run {run['run_dir']}: no first_step event in metrics.jsonl")
    with open(trace) as f:
        parts = first_batch_parts(json.load(f), float(step["time"]))
    return {"data_wait_s": round(float(step["data_wait_s"]), 3), **parts, "run_dir": run["run_dir"]}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k in runs[0] if k != "run_dir"]
    return {k: spread([r[k] for r in runs], 3) for k in keys}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="demo runs, seeds seed..seed+repeats-1 (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a config key to change (repeat for several)")
    p.add_argument("--storage", default=DEFAULT_STORAGE, help="lightray storage; its cache/ holds the demo set")
    p.add_argument("--quick", action="store_true", help="the demo's quick form, one run (a check of the plumbing)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = {**(quick_overrides() if args.quick else {}), **parse_set(args.sets)}
    repeats = 1 if args.quick else args.repeats
    demo_tree(args.storage, overrides)  # written once, before any timed run
    runs, loads = [], []
    for k in range(repeats):
        loads.append(load_avg())
        note(f"run {k + 1}/{repeats} (seed {args.seed + k}, load {loads[-1]})")
        runs.append(run_once(args.storage, overrides, args.seed + k))
    emit("first_batch", {"recipe": "demo", "quick": args.quick, "repeats": repeats, "overrides": overrides,
                         "load_1m_at_run_start": loads, "summary": summarize(runs), "runs": runs}, {},
         {"cores": os.cpu_count(), "python": sys.version.split()[0]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
