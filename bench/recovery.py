"""Recovery from a lost node: with and without the preemption notice, side by side in one run.

On a multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head without the "trainer"
resource and two worker nodes with one each, so each of the 2 Train workers has its own node), the real
driver (``python app/run.py --smoke-test``, 4 epochs / 48 steps, a checkpoint every 4 steps, a metrics line
every step) is interrupted once, at the same point (the first step after ``--fail-after`` samples), in two ways:

(a) ``no_notice``: the node of a Train worker is removed (raylet and every process on it killed at once, as a
    spot machine reclaimed without warning); a replacement node is added at the same moment.
(b) ``notice``: the node is drained with reason PREEMPTION and a 120 s deadline (what the spot watcher does on
    the cloud's notice); a replacement is added at the same moment; once Ray Train has restarted off the
    draining node, the node is removed.

Figures per variant:
- ``restart_overhead_s``: seconds from the failure (the node removal, or the drain call) to the first training
  step completed after the restart (its metrics line; one line per step).
- ``lost_samples`` / ``lost_seconds``: from summary.json's ``lost_work`` for that restart: samples trained
  after the checkpoint the restart resumed from (rolled back and trained again), and the seconds they took.
- ``resumed_at`` / ``failed_at``: samples_seen of the resume checkpoint / of the last step reported before it.

Ratios (no_notice over notice, so bigger = the notice helps more):
- ``lost_samples_no_notice_over_notice``: ``(lost_no_notice + B) / (lost_notice + B)`` with ``B`` the global
  batch at the failure. The notice is meant to lose nothing (0 samples), so a plain quotient would divide by
  zero: adding one step's batch to both sides keeps the ratio finite, 1.0 when both lose the same, and
  ``1 + lost/B`` (the steps the notice saved, plus one) when the notice loses nothing.
- ``lost_seconds_no_notice_over_notice``: ``(s_no_notice + t) / (s_notice + t)`` with ``t`` the median step time
  of the run (the same one-step guard, in seconds).
- ``restart_overhead_no_notice_over_notice``: plain quotient (both are well above zero).

The machine is shared: ``machine`` carries the load averages before and after. Run:
``python -m bench.recovery`` (``--keep DIR`` keeps the run folders). Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Machine, emit  # noqa: E402
from tests.faults import (  # noqa: E402  (the same real cluster + driver helpers as the tests)
    NodeCluster,
    checkpoints,
    cluster_driver,
    events,
    finish,
    kill_group,
    last_samples,
    records,
    wait_for,
)

TIMEOUT_S = 600


def _first_step_after_restart(run: pathlib.Path) -> dict:
    recs = records(run)
    i = next(i for i, r in enumerate(recs) if r.get("event") == "restart")
    return next(r for r in recs[i + 1:] if "event" not in r and "val_top1" not in r)


def _step_time(run: pathlib.Path) -> float:
    """Median seconds per training step while nothing failed (consecutive one-step metrics lines)."""
    recs = [r for r in records(run) if "event" not in r and "val_top1" not in r]
    gaps = [b["time"] - a["time"] for a, b in zip(recs, recs[1:]) if b["step"] == a["step"] + 1]
    return statistics.median(gaps) if gaps else 0.0


def run_variant(nodes: NodeCluster, storage: pathlib.Path, cache: pathlib.Path, name: str, notice: bool,
                fail_after: int) -> dict:
    proc = cluster_driver(nodes, storage, name, "--report.every_steps=1", cache=cache)
    run = storage / name
    try:
        wait_for(lambda: checkpoints(run) and last_samples(run) >= fail_after, TIMEOUT_S,
                 f"{name}: samples_seen >= {fail_after}", proc, interval=0.05)
        doomed = nodes.nodes[0]
        t_fail = time.time()
        if notice:
            from app.train.spot_watcher import drain_node_for_preemption

            accepted, why = drain_node_for_preemption(doomed.node_id, int((t_fail + 120) * 1000),
                                                      "bench.recovery: spot interruption notice")
            if not accepted:
                raise RuntimeError(f"drain of {doomed.node_id} rejected: {why}")
        else:
            nodes.remove_worker(doomed)
        nodes.add_worker()
        if notice:
            wait_for(lambda: events(run, "restart"), TIMEOUT_S, f"{name}: restart", proc)
            nodes.remove_worker(doomed)
        finish(proc, timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    summary = json.loads((run / "summary.json").read_text())
    if summary["status"] != "finished" or not summary["lost_work"]:
        raise RuntimeError(f"{name}: run {summary['status']} with lost_work {summary['lost_work']}")
    lost = summary["lost_work"][0]
    first = _first_step_after_restart(run)
    return {"restart_overhead_s": round(first["time"] - t_fail, 3),
            "restart_event_after_last_step_s": round(lost["restart_overhead_s"], 3),
            "lost_samples": int(lost["lost_samples"]),
            "lost_seconds": round(float(lost["lost_seconds"] or 0.0), 3),
            "resumed_at": int(lost["resumed_at"]), "failed_at": int(lost["resumed_at"] + lost["lost_samples"]),
            "batch_at_failure": int(first["batch_size"]), "step_s": round(_step_time(run), 4),
            "restarts": summary["restarts"], "preemption_checkpoints": summary["preemption_checkpoints"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fail-after", type=int, default=6 * 64,
                   help="interrupt at the first step reported with at least this many samples (default: 2 steps "
                        "after the step-4 checkpoint)")
    p.add_argument("--keep", metavar="DIR", help="write the runs here and keep them")
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    # Ray's driver prints node deaths (the very thing measured here) to stdout from a background thread: send
    # everything to stderr while measuring, so that stdout carries only the one JSON line.
    sys.stdout.flush()
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    machine = Machine()
    tmp = tempfile.TemporaryDirectory(prefix="bench-recovery-")
    base = pathlib.Path(args.keep or tmp.name)
    storage, cache = base / "runs", base / "cache"
    storage.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    stamp = time.strftime("%H%M%S")
    with NodeCluster(workers=2) as nodes:
        no_notice = run_variant(nodes, storage, cache, f"no-notice-{stamp}", False, args.fail_after)
        notice = run_variant(nodes, storage, cache, f"notice-{stamp}", True, args.fail_after)
    batch = no_notice["batch_at_failure"]
    step = max(no_notice["step_s"], notice["step_s"], 1e-3)
    ratios = {
        "lost_samples_no_notice_over_notice": round((no_notice["lost_samples"] + batch) /
                                                    (notice["lost_samples"] + batch), 3),
        "lost_seconds_no_notice_over_notice": round((no_notice["lost_seconds"] + step) /
                                                    (notice["lost_seconds"] + step), 3),
        "restart_overhead_no_notice_over_notice": round(no_notice["restart_overhead_s"] /
                                                        max(notice["restart_overhead_s"], 1e-3), 3),
    }
    figures = {"no_notice": no_notice, "notice": notice, "fail_after_samples": args.fail_after,
               "checkpoint_every_steps": 4, "workers": 2, "bench_wall_s": round(time.time() - t0, 1)}
    nodes_desc = "ray.cluster_utils.Cluster: head (2 CPU) + 2 worker nodes (1 CPU, trainer=1)"
    emit("recovery", figures, ratios, machine.finish(argv, nodes=nodes_desc), out=json_out)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
