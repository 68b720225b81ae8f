"""Recovery from lost nodes: kills at seeded random steps, several per run, with and without the notice.

On a multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head without the "trainer"
resource and two worker nodes with one each, so each of the 2 Train workers has its own node), the real
driver (``python app/run.py --smoke-test``, 4 epochs / 48 steps, a checkpoint every ``CHECKPOINT_EVERY`` = 4
steps, a metrics line every step) is interrupted ``--kills`` times per variant, at steps drawn from
``--seed`` (uniform over the run, sorted, at least ``MIN_GAP`` steps apart; the same steps for every
variant). A kill fires at the first step reported at or after its target once the previous kill's restart
has happened. Variants (``--variants``):

(a) ``no_notice``: the node of a Train worker is removed (raylet and every process on it killed at once, as a
    spot machine reclaimed without warning); a replacement node is added at the same moment.
(b) ``notice``: the node is drained with reason PREEMPTION and a 120 s deadline (what the spot watcher does on
    the cloud's notice); a replacement is added at the same moment; once Ray Train has restarted off the
    draining node, the node is removed.

Per kill (``figures.<variant>.kills``), all measured from the run's own metrics.jsonl:
- ``target_step``: the seeded step; ``failed_step``: the last step reported before the restart (the kill lands
  on the step in flight after it); ``resumed_step``: the step of the checkpoint the restart resumed from.
- ``lost_steps`` = failed_step - resumed_step (rolled back and trained again), ``lost_samples`` and
  ``lost_seconds`` from summary.json's ``lost_work``; ``steps_since_checkpoint`` = failed_step mod the
  checkpoint interval: what an interval checkpoint alone would lose at that step (the model the measurement
  is compared against), and ``lost_over_interval`` = lost_steps / interval.
- ``restart_overhead_s``: seconds from the failure (the node removal, or the drain call) to the first training
  step completed after the restart (its metrics line; one line per step).

Per variant: the distribution over kills (``median``, ``min``, ``max``, ``mean``) of lost steps, lost seconds
and restart overhead, and ``lost_steps_matches_interval_model``: every kill lost exactly the steps since the
last interval checkpoint (for ``notice``: the preemption checkpoint should make it 0).

Ratios (no_notice over notice, both variants run): medians, with one step (or one median step time) added
to both sides of the lost-work ratios, since the notice is meant to lose nothing and a plain quotient would
divide by zero: 1.0 when both lose the same.

The machine is shared: ``machine`` carries the load averages before and after. Run:
``python -m bench.recovery [--kills 3] [--seed 0] [--variants no_notice,notice] [--keep DIR]``. Prints ONE
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Machine, emit, json_stdout  # noqa: E402
from tests.faults import (  # noqa: E402  (the same real cluster + driver helpers as the tests)
    NodeCluster,
    checkpoints,
    cluster_driver,
    events,
    finish,
    kill_group,
    records,
    run_schedule,
    steps_for,
    wait_for,
)

TIMEOUT_S = 600
TOTAL_STEPS = 48  # tests.faults.long_run(4): 2 epochs x 8 steps of 64, then 2 epochs x 16 steps of 32
CHECKPOINT_EVERY = 4  # long_run's --checkpoint.every_steps
MIN_GAP = 3  # steps between two kills: the next target lies beyond the previous kill's rollback
VARIANTS = ("no_notice", "notice")


def kill_plan(seed: int, kills: int, first: int = CHECKPOINT_EVERY + 1, last: int = TOTAL_STEPS - 4,
              min_gap: int = MIN_GAP) -> list[int]:
    """``kills`` distinct steps in ``[first, last]``, drawn from ``seed``, sorted, at least ``min_gap`` apart.

    Drawn as ``kills`` uniform picks from the range shrunk by the gaps, then spread out again, so every
    allowed plan is equally likely (no rejection loop that could run long on a crowded range)."""
    room = last - first + 1 - (kills - 1) * (min_gap - 1)
    if kills < 1 or room < kills:
        raise ValueError(f"kills: bad value {kills}; at most {(last - first + min_gap) // min_gap} fit in steps "
                         f"{first}..{last} at {min_gap} apart")
    picks = sorted(random.Random(seed).sample(range(room), kills))
    return [first + p + i * (min_gap - 1) for i, p in enumerate(picks)]


def distribution(values: list[float]) -> dict[str, float | int | None]:
    """Median, min, max and mean of ``values`` (all None when there are none)."""
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None, "mean": None}
    return {"n": len(values), "median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3), "mean": round(statistics.fmean(values), 3)}


def _segments(recs: list[dict]) -> list[list[dict]]:
    """Training metrics lines per worker-group start (the first start, then one list per restart)."""
    out: list[list[dict]] = [[]]
    for r in recs:
        if r.get("event") == "restart":
            out.append([])
        elif "event" not in r and "val_top1" not in r and "step" in r:
            out[-1].append(r)
    return out


def current_step(recs: list[dict], restarts: int) -> int:
    """The last step reported by the worker group started after ``restarts`` restarts (0 before any)."""
    segs = _segments(recs)
    if len(segs) <= restarts or not segs[restarts]:
        return 0
    return int(segs[restarts][-1]["step"])


def kill_accounting(recs: list[dict], lost_work: list[dict], fail_times: list[float], targets: list[int],
                    interval: int, step_of_samples: Any) -> list[dict[str, Any]]:
    """One entry per kill from the run's metrics lines, its summary's ``lost_work`` and the kill wall times.

    ``step_of_samples`` turns a samples_seen count into the recipe's global step (phases change the batch)."""
    segs = _segments(recs)
    out = []
    for i, (t_fail, target) in enumerate(zip(fail_times, targets)):
        before, after = segs[i], segs[i + 1] if i + 1 < len(segs) else []
        lost = lost_work[i] if i < len(lost_work) else {}
        failed = int(before[-1]["step"]) if before else 0
        resumed = int(step_of_samples(int(lost.get("resumed_at", 0))))
        lost_steps = failed - resumed
        out.append({"target_step": target, "failed_step": failed, "resumed_step": resumed,
                    "lost_steps": lost_steps, "steps_since_checkpoint": failed % interval,
                    "lost_over_interval": round(lost_steps / interval, 3),
                    "lost_samples": int(lost.get("lost_samples", 0)),
                    "lost_seconds": round(float(lost.get("lost_seconds") or 0.0), 3),
                    "restart_overhead_s": round(after[0]["time"] - t_fail, 3) if after else None,
                    "restart_event_after_last_step_s": round(float(lost.get("restart_overhead_s", 0.0)), 3)})
    return out


def summarise(kills: list[dict[str, Any]], interval: int, notice: bool) -> dict[str, Any]:
    """The variant's distributions over its kills, and whether the interval model held at every kill."""
    expect = [0 if notice else k["steps_since_checkpoint"] for k in kills]
    return {"kills": kills, "checkpoint_every_steps": interval,
            "lost_steps": distribution([k["lost_steps"] for k in kills]),
            "lost_over_interval": distribution([k["lost_over_interval"] for k in kills]),
            "lost_seconds": distribution([k["lost_seconds"] for k in kills]),
            "restart_overhead_s": distribution([k["restart_overhead_s"] for k in kills
                                                if k["restart_overhead_s"] is not None]),
            "lost_steps_matches_interval_model": all(k["lost_steps"] == e for k, e in zip(kills, expect))}


def _step_time(run: pathlib.Path) -> float:
    """Median seconds per training step while nothing failed (consecutive one-step metrics lines)."""
    recs = [r for r in records(run) if "event" not in r and "val_top1" not in r]
    gaps = [b["time"] - a["time"] for a, b in zip(recs, recs[1:]) if b["step"] == a["step"] + 1]
    return statistics.median(gaps) if gaps else 0.0


def _due(run: pathlib.Path, restarts: int, target: int) -> bool:
    """The next kill is due: the previous kill's restart happened and the new group reached ``target``."""
    recs = records(run)
    return bool(checkpoints(run)) and sum(r.get("event") == "restart" for r in recs) == restarts \
        and current_step(recs, restarts) >= target


def run_variant(nodes: NodeCluster, storage: pathlib.Path, cache: pathlib.Path, name: str, notice: bool,
                targets: list[int]) -> dict[str, Any]:
    proc = cluster_driver(nodes, storage, name, "--report.every_steps=1", cache=cache)
    run = storage / name
    fail_times: list[float] = []
    try:
        for i, target in enumerate(targets):
            wait_for(lambda i=i, target=target: _due(run, i, target), TIMEOUT_S,
                     f"{name}: kill {i + 1} at step >= {target}", proc, interval=0.05)
            doomed = nodes.nodes[0]
            fail_times.append(time.time())
            if notice:
                from lightray.driver.spot_watcher import drain_node_for_preemption

                accepted, why = drain_node_for_preemption(doomed.node_id, int((fail_times[-1] + 120) * 1000),
                                                          "bench.recovery: spot interruption notice")
                if not accepted:
                    raise RuntimeError(f"drain of {doomed.node_id} rejected: {why}")
            else:
                nodes.remove_worker(doomed)
            nodes.add_worker()
            if notice:
                wait_for(lambda i=i: len(events(run, "restart")) > i, TIMEOUT_S, f"{name}: restart {i + 1}", proc)
                nodes.remove_worker(doomed)
        finish(proc, timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    summary = json.loads((run / "summary.json").read_text())
    if summary["status"] != "finished" or len(summary["lost_work"]) != len(targets):
        raise RuntimeError(f"{name}: run {summary['status']} with {len(summary['lost_work'])} restarts for "
                           f"{len(targets)} kills: {summary['lost_work']}")
    sched = run_schedule(run)
    kills = kill_accounting(records(run), summary["lost_work"], fail_times, targets, CHECKPOINT_EVERY,
                            lambda samples: steps_for(sched, samples))
    return {**summarise(kills, CHECKPOINT_EVERY, notice), "step_s": round(_step_time(run), 4),
            "restarts": summary["restarts"], "preemption_checkpoints": summary["preemption_checkpoints"]}


def ratios_of(no_notice: dict[str, Any], notice: dict[str, Any]) -> dict[str, float]:
    """no_notice over notice, medians over the kills, one step's guard on the lost-work ratios."""
    step = max(no_notice["step_s"], notice["step_s"], 1e-3)
    return {
        "lost_steps_no_notice_over_notice": round((no_notice["lost_steps"]["median"] + 1) /
                                                  (notice["lost_steps"]["median"] + 1), 3),
        "lost_seconds_no_notice_over_notice": round((no_notice["lost_seconds"]["median"] + step) /
                                                    (notice["lost_seconds"]["median"] + step), 3),
        "restart_overhead_no_notice_over_notice": round(no_notice["restart_overhead_s"]["median"] /
                                                        max(notice["restart_overhead_s"]["median"], 1e-3), 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=3, help="kills per variant (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill steps (the same steps for each variant)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: no_notice, notice")
    p.add_argument("--keep", metavar="DIR", help="write the runs here and keep them")
    args = p.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or any(v not in VARIANTS for v in variants):
        p.error(f"--variants: bad value {args.variants!r}; allowed: {', '.join(VARIANTS)}")
    try:
        targets = kill_plan(args.seed, args.kills)
    except ValueError as exc:
        p.error(f"--{exc}")
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    json_out = json_stdout()  # Ray prints the node deaths measured here to stdout
    machine = Machine()
    tmp = tempfile.TemporaryDirectory(prefix="bench-recovery-")
    base = pathlib.Path(args.keep or tmp.name)
    storage, cache = base / "runs", base / "cache"
    storage.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%H%M%S")
    figures: dict[str, Any] = {"kill_steps": targets, "seed": args.seed, "total_steps": TOTAL_STEPS,
                               "checkpoint_every_steps": CHECKPOINT_EVERY, "workers": 2}
    with NodeCluster(workers=2) as nodes:
        for v in variants:
            figures[v] = run_variant(nodes, storage, cache, f"{v.replace('_', '-')}-{stamp}", v == "notice",
                                     targets)
    ratios = ratios_of(figures["no_notice"], figures["notice"]) if len(variants) == 2 else {}
    nodes_desc = "ray.cluster_utils.Cluster: head (2 CPU) + 2 worker nodes (1 CPU, trainer=1)"
    emit("recovery", figures, ratios, machine.finish(argv, nodes=nodes_desc), out=json_out)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
