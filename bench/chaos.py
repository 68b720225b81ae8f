"""Chaos soak: one run of the demo on a local multi-node cluster under a seeded schedule of faults.

The cluster is ``ray.cluster_utils.Cluster`` on this machine (tests/faults.py ``NodeCluster``): a head without
the "trainer" resource and ``--nodes`` worker nodes with one each; the run is the real driver
(``python app/run.py --smoke-test``, elastic ``--workers 1:N``, a checkpoint every 4 steps, a metrics line
every step). The faults, in a seeded order at seeded points of the run, one after the other (each once the
run has recovered from the one before):

- ``node_kill``: a worker node's raylet and every process on it killed at once (a spot machine reclaimed
  without notice); the run goes on with the nodes left.
- ``preemption``: a spot notice served by the local metadata server (tests/imds_server.py) to the real spot
  watcher actor (app/driver/spot_watcher.py) on one worker node, which drains its node with reason PREEMPTION;
  once Ray Train has left it the node is removed.
- ``node_add``: after each of the two above, a node is added back and the run grows again.
- ``driver_kill``: the driver process killed (SIGKILL) and started again with ``--resume``; the injection records
  whether the new driver cancelled the dead one's resource bookings (app/driver/stale_runs.py), which would
  otherwise hold the worker group back for 3 minutes.
- ``checkpoint_corrupt``: the driver killed, a byte flipped in the newest checkpoint's state file, the driver
  started again with ``--resume``: the resume must skip that checkpoint and take the one before.
- ``storage_write_fail``: the folder name of the next checkpoint taken by a plain file, so that its write
  fails once (as on a full or read-only checkpoint directory); the file is removed once the worker group has
  restarted, so that the retry writes it.
- ``peer_hang``: one Train worker process stopped (SIGSTOP), as a worker wedged in a driver call or a
  collective: its peers' next collective fails after ``scaling.collective_timeout_s`` (``--collective-timeout-s``
  here, 45 s by default against the recipe's 300 s), and Ray Train replaces the group, charged to the preemption
  budget: the stopped process answers nothing (app/driver/machine_loss.py). The injection records
  whether the stopped process was ended by the restart (a hung worker left behind would hold its GPU).

Figures per fault kind (``figures.faults.<kind>``): ``injected``, ``survived`` (the run trained on after it and
finished), ``outlived`` (the run finished without a step after it: too late to tell, never counted as
survived; a fault whose turn comes past 75 % of the run is not injected at all, ``figures.not_injected``),
``lost_samples`` (samples trained again: the last step reported before the start that
followed the fault minus the samples_seen that start resumed from), ``restart_s`` (seconds from the
injection to the first training step of the next start; for ``node_add`` to the first step at the grown
size). ``figures.audit_exact``: per epoch, the sample ids the final model carries equal the epoch plan's as a
multiset (tests/faults.py). ``ratios.top1_over_uninterrupted``: final top-1 over that of an uninterrupted run
of the same recipe and seed on the same cluster; ``ratios.wall_over_uninterrupted`` the wall times.

``--group-start-timeout-s`` sets Ray Train's worker-group start timeout in the driver (default: Ray's 60 s). After
a preemption the elastic group's restart asks for the full size while Ray Train still counts the draining node,
and waits that long for a placement group that cannot be made before falling back to the nodes left: measured
here, 60 of the 80 s from the preemption checkpoint to the restart (57 s with 15: the retries keep asking for
the full size until the draining node is gone). A short form may lower it (a timed-out start is retried, never
charged to ``max_failures``); the default figures keep Ray's.

``--minutes`` sets the length: the run's epochs grow with it (about one epoch a minute on a loaded 2-core
machine, faults included; the default 10 is the soak). The machine is shared: ``machine`` carries the load
averages. Run: ``python -m bench.chaos [--minutes 10] [--seed 0]``. Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = pathlib.Path(__file__).parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Machine, emit, json_stdout, note, stopped_process_ended  # noqa: E402
from tests.faults import (  # noqa: E402  (the same real cluster + driver helpers as the tests)
    NodeCluster,
    carried_samples,
    checkpoints,
    cluster_driver,
    finish,
    kill_group,
    planned_samples,
    records,
    run_schedule,
    same_multiset,
    steps_for,
    train_worker_pids,
)

PRIMARY = ("node_kill", "preemption", "driver_kill", "checkpoint_corrupt", "storage_write_fail", "peer_hang")
KINDS = (*PRIMARY, "node_add")
CHECKPOINT_EVERY = 4
NOTICE_S = 30.0  # the spot notice's deadline (AWS gives 120 s; shorter keeps the soak short)
# A fault is placed only where the run can still react to it: not past this fraction of its samples (a spot
# notice needs its drain, a restart its first step, before the run ends).
LATE = 0.75
STEP_TIMEOUT_S = 600  # no progress for this long = the run is stuck (a failure of the bench, not a figure)


def epochs_for(minutes: float) -> int:
    return max(6, round(minutes))  # 6 epochs (80 steps) leave room for every fault once


def fault_plan(seed: int, kinds: tuple[str, ...] = PRIMARY) -> list[str]:
    """The faults (``kinds``, default every primary kind) in a seeded order; a node is added back right after
    each node loss."""
    order = [k for k in PRIMARY if k in kinds]
    random.Random(seed).shuffle(order)
    plan: list[str] = []
    for kind in order:
        plan.append(kind)
        if kind in ("node_kill", "preemption"):
            plan.append("node_add")
    return plan


def trigger_points(seed: int, n: int, total: int) -> list[int]:
    """samples_seen at which each primary fault may fire: seeded, sorted, within 10-60 % of the run (each
    recovery takes steps, and the last fault must still find a run to interrupt)."""
    rng = random.Random(seed + 1)
    return sorted(int(total * rng.uniform(0.10, 0.60)) for _ in range(n))


def _train(recs: list[dict]) -> list[dict]:
    return [r for r in recs if "event" not in r and "val_top1" not in r]


def _starts_after(recs: list[dict], t: float) -> list[dict]:
    return [r for r in recs if r.get("event") in ("start", "restart") and r.get("time", 0) > t]


def next_checkpoint_samples(sched, after: int, margin_steps: int = 1) -> int | None:
    """samples_seen of the first checkpoint (an interval or an epoch end) the run writes more than
    ``margin_steps`` steps after ``after``, a reported samples_seen (the step after it may already be in
    flight). Stepping from ``after`` keeps to the run's step grid: a target off the grid is a checkpoint the
    run never writes, and a write meant to fail would not."""
    s, steps = after, 0
    while s < sched.total_samples:
        epoch = next(e for e in range(sched.epochs) if s < sched.epoch_start(e + 1))
        s += sched.phase_for_epoch(epoch).batch_size
        steps += 1
        if steps > margin_steps and (steps_for(sched, s) % CHECKPOINT_EVERY == 0 or s == sched.epoch_start(epoch + 1)):
            return s
    return None


class Soak:
    """One run under the fault plan; ``run()`` returns the per-kind figures."""

    def __init__(self, nodes: NodeCluster, storage: pathlib.Path, cache: pathlib.Path, name: str, epochs: int,
                 seed: int, imds, kinds: tuple[str, ...] = PRIMARY, env: dict | None = None,
                 collective_timeout_s: int = 45, max_failures: int | None = None):
        self.nodes, self.storage, self.cache, self.name = nodes, storage, cache, name
        self.env = env or {}
        self.kinds = kinds
        self.epochs, self.seed, self.imds = epochs, seed, imds
        self.run_dir = storage / name
        self.args = ("--workers", f"1:{nodes.n_workers}", "--scaling.resize_check_s=2", "--checkpoint.keep=3",
                     "--report.every_steps=1", f"--scaling.seed={seed}",
                     f"--scaling.collective_timeout_s={collective_timeout_s}",
                     *([f"--scaling.max_failures={max_failures}"] if max_failures is not None else []))
        self.proc = None
        self.injected: list[dict] = []  # {kind, time, before (last samples_seen), ...}
        self.skipped: list[dict] = []  # faults whose turn came too late in the run to react to them
        self.outputs: list[list[str]] = []  # each driver's output lines
        self._reader: threading.Thread | None = None

    # -- the driver ------------------------------------------------------------------------------------
    def _start_driver(self, resume: bool) -> None:
        self.proc = cluster_driver(self.nodes, self.storage, self.name, *self.args, *(["--resume"] if resume else []),
                                   cache=self.cache, epochs=self.epochs, env=self.env)
        # Read the driver's output as it comes: a long soak prints more than a pipe holds, and a driver blocked
        # on a full pipe would look like a hung run.
        lines: list[str] = []
        self.outputs.append(lines)
        self._reader = threading.Thread(target=lambda out=self.proc.stdout: lines.extend(out), daemon=True)
        self._reader.start()

    def _kill_driver(self) -> None:
        kill_group(self.proc)
        self._reader.join(timeout=30)

    def _finish_driver(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(self.proc)
            raise
        finally:
            self._reader.join(timeout=30)
        if self.proc.returncode != 0:
            raise RuntimeError(f"chaos: driver exited {self.proc.returncode}:\n{''.join(self.outputs[-1])[-6000:]}")

    def _wait(self, pred, what: str, timeout: float = STEP_TIMEOUT_S):
        end = time.time() + timeout
        while time.time() < end:
            value = pred()
            if value:
                return value
            if self.proc.poll() is not None:
                return None  # the driver ended (finished or failed): the caller decides
            time.sleep(0.2)
        raise RuntimeError(f"chaos: timed out after {timeout:.0f} s waiting for {what}")

    def _last(self) -> dict:
        train = _train(records(self.run_dir))
        return train[-1] if train else {}

    # -- the faults ------------------------------------------------------------------------------------
    def _inject(self, kind: str) -> dict:
        before = self._last()
        fault = {"kind": kind, "time": time.time(), "before": before.get("samples_seen", 0)}
        note(f"chaos: {kind} at samples_seen={fault['before']}")
        if kind == "node_kill":
            self.nodes.remove_worker(self.nodes.nodes[0])
        elif kind == "node_add":
            self.nodes.add_worker()
        elif kind == "preemption":
            self._preempt(fault)
        elif kind in ("driver_kill", "checkpoint_corrupt"):
            self._kill_driver()
            if kind == "checkpoint_corrupt":
                newest = checkpoints(self.run_dir)[-1]
                state = newest / "state_rank0.pt"
                data = bytearray(state.read_bytes())
                data[len(data) // 2] ^= 0xFF
                state.write_bytes(bytes(data))
                fault["corrupted"] = newest.name
            fault["time"] = time.time()  # the new driver's start counts from here
            self._start_driver(resume=True)
        elif kind == "peer_hang":
            pids = train_worker_pids(self.nodes)
            if pids:
                os.kill(pids[0], signal.SIGSTOP)
                fault["stopped_pid"] = pids[0]
        elif kind == "storage_write_fail":
            target = next_checkpoint_samples(run_schedule(self.run_dir), fault["before"])
            if target is not None:
                blocker = self.run_dir / f"checkpoint_{target:012d}"
                blocker.write_text("not a checkpoint folder: this write is meant to fail once\n")
                fault["blocker"], fault["blocked_at"] = str(blocker), target
        self.injected.append(fault)
        return fault

    def _preempt(self, fault: dict) -> None:
        from lightray.config import ScalingConfig
        from lightray.driver.spot_watcher import start_watchers, stop_watchers

        doomed = self.nodes.nodes[0]
        cfg = ScalingConfig(spot_watcher="on", spot_endpoint=self.imds.url, spot_poll_s=0.5)
        handles = start_watchers(cfg, f"chaos-{self.name}", node_ids=[doomed.node_id])
        fault["time"] = time.time()
        deadline = fault["time"] + NOTICE_S
        self.imds.serve_notice(in_s=NOTICE_S)
        try:
            # The run checkpoints at the notice (and may already restart elsewhere) ...
            self._wait(lambda: [r for r in records(self.run_dir) if r.get("time", 0) > fault["time"] and
                                r.get("event") in ("preemption_checkpoint", "start", "restart")],
                       "the checkpoint for the notice")
            # ... and the machine goes at the notice's deadline, as a reclaimed spot machine does: Ray Train may
            # count a draining node's resources as free until then, and place a new worker group there.
            time.sleep(max(0.0, deadline - time.time()))
        finally:
            self.imds.clear()
            stop_watchers(handles)
        self.nodes.remove_worker(doomed)

    def _recovered(self, fault: dict) -> bool:
        recs = records(self.run_dir)
        if fault["kind"] == "node_add":
            return any(r["time"] > fault["time"] and r["world_size"] == self.nodes.n_workers for r in _train(recs))
        if fault["kind"] == "storage_write_fail":
            if "blocker" not in fault:
                return True
            blocker = pathlib.Path(fault["blocker"])
            if _starts_after(recs, fault["time"]) and blocker.is_file():
                blocker.unlink()  # failed once: the retry may write it
            passed = any(r["samples_seen"] > fault["blocked_at"] for r in _train(recs) if r["time"] > fault["time"])
            if passed and blocker.is_file():
                blocker.unlink()
            return passed and not blocker.exists()
        starts = _starts_after(recs, fault["time"])
        done = bool(starts) and any(r["time"] > starts[0]["time"] for r in _train(recs))
        if done and "stopped_pid" in fault:
            fault["hung_process_ended"] = stopped_process_ended(fault.pop("stopped_pid"))
        if done and fault["kind"] in ("driver_kill", "checkpoint_corrupt"):  # the new driver's own word
            fault["released_bookings"] = any("cancelled the resource bookings" in line for line in self.outputs[-1])
        return done

    # -- the run ---------------------------------------------------------------------------------------
    def run(self) -> float:
        """Run to the end under the plan; returns the wall time."""
        t0 = time.time()
        self._start_driver(resume=False)
        self._wait(lambda: (self.run_dir / "config.yaml").is_file() and checkpoints(self.run_dir),
                   "the first checkpoint")
        plan = fault_plan(self.seed, self.kinds)
        total = run_schedule(self.run_dir).total_samples
        points = iter(trigger_points(self.seed, len(self.kinds), total))
        for i, kind in enumerate(plan):
            if self.proc.poll() is not None:  # the run ended while the fault before recovered: none of these
                self.skipped += [{"kind": k, "at": None, "why": "the run had ended"} for k in plan[i:]]
                break
            if kind != "node_add":
                at = next(points)
                if self._wait(lambda at=at: self._last().get("samples_seen", 0) >= at, f"samples_seen >= {at}") is None:
                    self.skipped += [{"kind": k, "at": None, "why": "the run had ended"} for k in plan[i:]]
                    break  # the run ended before this fault's turn
                if self._last().get("samples_seen", 0) > LATE * total:  # earlier recoveries took the run this far
                    self.skipped.append({"kind": kind, "at": self._last().get("samples_seen", 0),
                                         "why": f"past {LATE:.0%} of the run"})
                    note(f"chaos: {kind} not injected: the run is past {LATE:.0%} of its samples")
                    continue
            fault = self._inject(kind)
            self._wait(lambda fault=fault: self._recovered(fault), f"recovery from {kind}")
        self._finish_driver(timeout=STEP_TIMEOUT_S * 2)
        return time.time() - t0

    def figures(self) -> dict:
        recs = records(self.run_dir)
        summary = json.loads((self.run_dir / "summary.json").read_text())
        finished = summary["status"] == "finished"
        out = {k: {"injected": 0, "survived": 0, "outlived": 0, "lost_samples": 0, "restart_s": []} for k in KINDS}
        details = []
        ends = [f["time"] for f in self.injected[1:]] + [float("inf")]
        for f, end in zip(self.injected, ends):
            row = out[f["kind"]]
            row["injected"] += 1
            # What followed this fault up to the next one (each fault is injected once the run recovered).
            after = [r for r in _train(recs) if f["time"] < r["time"] < end]
            starts = [s for s in _starts_after(recs, f["time"]) if s["time"] < end]
            start = None
            if f["kind"] == "node_add":  # the start that grew the group
                grown = [r for r in after if r["world_size"] == self.nodes.n_workers]
                first = grown[0] if grown else None
                start = ([s for s in starts if first is not None and s["time"] <= first["time"]] or [None])[-1]
            else:
                start = starts[0] if starts else None
                first = next((r for r in after if start is not None and r["time"] > start["time"]), None)
            # Trained again: from the checkpoint the start resumed at up to the last step reported before it.
            lost = None
            if start is not None:
                reported = [r["samples_seen"] for r in _train(recs) if r["time"] < start["time"]]
                lost = max(0, (reported[-1] if reported else 0) - start["samples_seen"])
            ok = finished and first is not None
            if f["kind"] == "checkpoint_corrupt":  # the resume must have skipped the corrupt checkpoint
                ok = ok and start is not None and any(f["corrupted"] in s for s in start.get("skipped_checkpoints", []))
            row["survived"] += int(ok)
            # The run ended before it took a step after the fault: it outlived the fault, which proves nothing
            # either way (counted apart, never as survived).
            # (For node_add: the run ended before it grew onto the new node.)
            outlived = finished and first is None
            row["outlived"] += int(outlived)
            row["lost_samples"] += int(lost or 0)
            if first is not None:
                row["restart_s"].append(round(first["time"] - f["time"], 1))
            details.append({k: v for k, v in f.items() if k not in ("blocker",)} | {
                "survived": ok, "outlived": outlived, "lost_samples": lost,
                "resumed_at": start["samples_seen"] if start else None, "starts": len(starts)})
        for row in out.values():
            times = row["restart_s"]
            row["restart_s"] = round(max(times), 1) if times else None  # the worst one of the kind
        return {"faults": out, "status": summary["status"], "samples_seen": summary["samples_seen"],
                "final_top1": summary["final_top1"], "restarts": summary["restarts"], "resizes": summary["resizes"],
                "injections": details, "not_injected": self.skipped}


def reference_run(nodes: NodeCluster, storage: pathlib.Path, cache: pathlib.Path, name: str, epochs: int,
                  seed: int, env: dict | None = None) -> tuple[dict, float]:
    t0 = time.time()
    proc = cluster_driver(nodes, storage, name, "--workers", f"1:{nodes.n_workers}", "--checkpoint.keep=3",
                          f"--scaling.seed={seed}", cache=cache, epochs=epochs, env=env)
    try:
        finish(proc, timeout=STEP_TIMEOUT_S * 2)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    return json.loads((storage / name / "summary.json").read_text()), time.time() - t0


def build_parser() -> argparse.ArgumentParser:
    """The bench's command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0, help="length of the soak (sets the run's epochs)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault order and points, and of the run")
    p.add_argument("--nodes", type=int, default=2, help="worker nodes (one Train worker each) beside the head")
    p.add_argument("--keep", metavar="DIR", help="write the runs here and keep them")
    p.add_argument("--cache", metavar="DIR",
                   help="the shard cache to use (and reuse: a repeated soak prepares its data once); default: a "
                        "fresh one beside the runs")
    p.add_argument("--faults", default=",".join(PRIMARY),
                   help=f"comma-separated fault kinds to inject (default all: {','.join(PRIMARY)}); node_add "
                        "follows every node loss")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the uninterrupted reference run (no top1/wall ratios; the test's short form)")
    p.add_argument("--group-start-timeout-s", type=float, default=None,
                   help="Ray Train's worker-group start timeout in the driver (default: Ray's, 60 s)")
    p.add_argument("--collective-timeout-s", type=int, default=45,
                   help="the run's scaling.collective_timeout_s: how long peers wait on a hung worker (peer_hang)")
    p.add_argument("--max-failures", type=int, default=None,
                   help="the run's scaling.max_failures (default: the recipe's); 0 shows that every fault injected is "
                        "charged to the preemption budget, none to the failures a run may have")
    return p


def _driver_env_and_kinds(p: argparse.ArgumentParser,
                          args: argparse.Namespace) -> tuple[dict[str, str], tuple[str, ...]]:
    """(the driver's extra environment, the fault kinds to inject), each checked against what is allowed."""
    if args.group_start_timeout_s is not None and args.group_start_timeout_s <= 0:
        p.error(f"--group-start-timeout-s={args.group_start_timeout_s}: expected a positive number of seconds")
    driver_env = ({} if args.group_start_timeout_s is None else
                  {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": f"{args.group_start_timeout_s:g}"})
    kinds = tuple(k.strip() for k in args.faults.split(",") if k.strip())
    unknown = sorted(set(kinds) - set(PRIMARY))
    if unknown or not kinds:
        p.error(f"--faults: unknown kind(s) {unknown or '(none given)'}; expected some of {','.join(PRIMARY)}")
    return driver_env, kinds


def soak_and_reference(args: argparse.Namespace, storage: pathlib.Path, cache: pathlib.Path, epochs: int,
                       kinds: tuple[str, ...], driver_env: dict[str, str]) -> tuple[Soak, float, dict, float | None]:
    """On one local cluster: the soak under faults, then (unless ``--no-reference``) the uninterrupted
    reference on the full cluster; returns (the soak, its wall seconds, the reference's summary, its wall)."""
    from tests.imds_server import ImdsServer

    stamp = time.strftime("%H%M%S")
    # Ray Train's barriers give up after the run's collective timeout, as cluster.yaml sets it on every node.
    node_env = {"RAY_TRAIN_COLLECTIVE_TIMEOUT_S": str(args.collective_timeout_s),
                "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S": str(args.collective_timeout_s)}
    with NodeCluster(workers=args.nodes, env=node_env) as nodes, ImdsServer() as imds:
        soak = Soak(nodes, storage, cache, f"chaos-{stamp}", epochs, args.seed, imds, kinds, env=driver_env,
                    collective_timeout_s=args.collective_timeout_s, max_failures=args.max_failures)
        try:
            wall = soak.run()
        finally:
            if soak.proc is not None and soak.proc.poll() is None:
                kill_group(soak.proc)
        ref, ref_wall = {"final_top1": None}, None
        if not args.no_reference:
            while len(nodes.nodes) < args.nodes:  # the reference runs on the full cluster
                nodes.add_worker()
            ref, ref_wall = reference_run(nodes, storage, cache, f"reference-{stamp}", epochs, args.seed,
                                          env=driver_env)
    return soak, wall, ref, ref_wall


def summarise(args: argparse.Namespace, soak: Soak, epochs: int, kinds: tuple[str, ...], wall: float, ref: dict,
              ref_wall: float | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(figures, ratios): the soak's figures with the sample audit and the reference beside it."""
    figures = soak.figures()
    diff = same_multiset(carried_samples(soak.run_dir), planned_samples(soak.run_dir))
    figures.update({
        "audit_exact": diff == {}, "audit_diff": {str(k): v for k, v in diff.items()},
        "uninterrupted_top1": ref["final_top1"], "epochs": epochs, "seed": args.seed,
        "plan": fault_plan(args.seed, kinds), "wall_s": round(wall, 1),
        "group_start_timeout_s": args.group_start_timeout_s, "collective_timeout_s": args.collective_timeout_s,
        "max_failures": args.max_failures,
        "uninterrupted_wall_s": round(ref_wall, 1) if ref_wall else None,
        "overhead_s": round(wall - ref_wall, 1) if ref_wall else None,
        "all_survived": all(r["survived"] == r["injected"] for r in figures["faults"].values()),
    })
    top1 = figures["final_top1"]
    ratios = {"top1_over_uninterrupted": round(top1 / ref["final_top1"], 3) if top1 and ref["final_top1"] else None,
              "wall_over_uninterrupted": round(wall / ref_wall, 3) if ref_wall else None}
    return figures, ratios


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    driver_env, kinds = _driver_env_and_kinds(p, args)
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    json_out = json_stdout()
    machine = Machine()
    tmp = tempfile.TemporaryDirectory(prefix="bench-chaos-")
    base = pathlib.Path(args.keep or tmp.name)
    storage, cache = base / "runs", pathlib.Path(args.cache) if args.cache else base / "cache"
    storage.mkdir(parents=True, exist_ok=True)
    epochs = epochs_for(args.minutes)
    soak, wall, ref, ref_wall = soak_and_reference(args, storage, cache, epochs, kinds, driver_env)
    figures, ratios = summarise(args, soak, epochs, kinds, wall, ref, ref_wall)
    nodes_desc = f"ray.cluster_utils.Cluster: head (2 CPU) + {args.nodes} worker nodes (1 CPU, trainer=1), token auth"
    emit("chaos", figures, ratios, machine.finish(argv, nodes=nodes_desc), out=json_out)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
