"""Start-up time and memory of a local run: ``python -m bench.footprint``.

Runs the real command (``python app/run.py --scaling.ray_address=local``, the demo and ``--smoke-test``)
in a subprocess and samples, every ~0.5 s, the PSS of every process it and its Ray cluster start: the
process tree under the command (a local cluster's daemons are the driver's children, Ray's workers the
raylet's), plus any process seen once in that tree and reparented since. PSS, not RSS: the shared pages
of torch and Ray's libraries are split between the processes that map them instead of counted in each.

Each process is put in one kind, from its command line and title (``ray::RayTrainWorker...``):
``driver``, ``ray_daemons`` (gcs_server, raylet, dashboard and its agents, log monitor, ...),
``train_workers``, ``data_workers`` (Ray Data operators, calibration and materialisation tasks),
``other_ray_workers`` (idle workers, the Train controller, the run log, ...), ``other`` (anything else in
the tree, such as the demo writer's process pool). A worker keeps the most specific kind it ever showed,
since an idle worker that ran a Ray Data task still holds what that task imported.

Time to the first step and its phases come from what the run writes: ``startup.json`` (driver phases)
and the ``start`` / ``first_step`` events in ``metrics.jsonl``, measured from the moment the bench
started the command. ``cold`` is a fresh storage and data cache; ``warm`` a new run on the same cache.

The one JSON line: ``figures.peak_pss_mb`` (the demo's largest total, warm or cold), ``figures.by_kind``
(MB per kind at that moment), ``figures.first_step_s.{cold,warm}`` (median over ``--repeats``), each run's
breakdown, worker counts and spreads; ``ratios`` compare with the goals (2.5 GB, 15 s warm, 30 s cold;
goal over figure, so bigger is better and >= 1 means met).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from bench.common import REPO, Machine, emit, load_avg, note, ratio, read_jsonl

RAY_START_TIMEOUT = "The current node timed out during startup"
GOALS = {"peak_pss_mb": 2500.0, "first_step_warm_s": 15.0, "first_step_cold_s": 30.0}
KINDS = ("driver", "ray_daemons", "train_workers", "data_workers", "other_ray_workers", "other")
# A worker keeps the most specific kind it showed (an idle worker that ran a Data task keeps its imports).
RANK = {"other": 0, "other_ray_workers": 1, "data_workers": 2, "train_workers": 3}
DAEMONS = re.compile(r"gcs_server|raylet|dashboard|log_monitor|monitor\.py|runtime_env|agent\.py|"
                     r"ray_client_server|process_reaper|reporter|autoscaler")
DATA_TITLES = re.compile(r"MapBatches|ReadRange|Read[A-Z]|Map\(|FlatMap|Filter|from_items|split|Split|"
                         r"_calibration_task|materiali|decode|build_shard|_map_unit|StatsActor|"
                         r"AutoscalingRequester|Coordinator|_execute|streaming", re.IGNORECASE)


def classify(proc_cmdline: list[str], name: str) -> str:
    """The kind of one process (not the driver) from its command line and name."""
    line = " ".join(proc_cmdline)
    if line.startswith("ray::"):
        title = line[5:]
        if title.startswith("RayTrainWorker"):
            return "train_workers"
        if DATA_TITLES.search(title):
            return "data_workers"
        return "other_ray_workers"
    if "default_worker.py" in line:  # a worker before it set its title
        return "other_ray_workers"
    if DAEMONS.search(line) or DAEMONS.search(name):
        return "ray_daemons"
    return "other"


def _has_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("libtorch" in line for line in f)
    except OSError:
        return False


@dataclass
class Tracked:
    proc: psutil.Process
    kind: str
    first_title: str
    titles: set[str] = field(default_factory=set)
    torch: bool = False
    peak_mb: float = 0.0


class Sampler:
    """Samples the PSS of the process tree under ``root_pid`` every ``every_s`` seconds, in a thread."""

    def __init__(self, root_pid: int, every_s: float = 0.5):
        self.root = psutil.Process(root_pid)
        self.every_s = every_s
        self.tracked: dict[int, Tracked] = {}
        self.samples: list[dict[str, Any]] = []  # {"t", "total_mb", "by_kind": {...}}
        self.peak: dict[str, Any] = {"total_mb": 0.0, "by_kind": {}, "t": None, "processes": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._n = 0

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _discover(self) -> None:
        try:
            procs = [self.root] + self.root.children(recursive=True)
        except psutil.Error:
            procs = []
        for p in procs:
            if p.pid in self.tracked:
                continue
            try:
                cmd, name = p.cmdline(), p.name()
            except psutil.Error:
                continue
            # The command's own process and the driver it forks (app/driver/guard.py) are both the driver.
            driver = p.pid == self.root.pid or (p.ppid() == self.root.pid and cmd == self.root.cmdline())
            kind = "driver" if driver else classify(cmd, name)
            self.tracked[p.pid] = Tracked(p, kind, " ".join(cmd)[:120])

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)

    def sample(self) -> None:
        self._discover()
        self._n += 1
        by_kind = dict.fromkeys(KINDS, 0.0)
        alive = 0
        for pid, tr in list(self.tracked.items()):
            try:
                if not tr.proc.is_running():
                    continue
                if tr.kind not in ("driver", "ray_daemons"):
                    cmd = tr.proc.cmdline()
                    title = " ".join(cmd)[:120]
                    tr.titles.add(title.split(" ")[0])
                    kind = classify(cmd, tr.proc.name())
                    if RANK.get(kind, 0) > RANK.get(tr.kind, 0):
                        tr.kind = kind
                mb = tr.proc.memory_full_info().pss / 2**20
            except psutil.Error:
                continue
            if not tr.torch and (self._n % 4 == 1):  # reading maps is not free; torch, once loaded, stays
                tr.torch = _has_torch(pid)
            tr.peak_mb = max(tr.peak_mb, mb)
            by_kind[tr.kind] += mb
            alive += 1
        total = sum(by_kind.values())
        now = time.time()
        self.samples.append({"t": now, "total_mb": total})
        if total > self.peak["total_mb"]:
            self.peak = {"total_mb": total, "by_kind": {k: round(v, 1) for k, v in by_kind.items()}, "t": now,
                         "processes": alive}

    def summary(self) -> dict[str, Any]:
        ray_workers = [t for t in self.tracked.values() if t.kind in RANK and t.kind != "other"]
        by_kind_count: dict[str, int] = {}
        torch_by_kind: dict[str, int] = {}
        peak_by_kind_process: dict[str, float] = {}
        for t in self.tracked.values():
            by_kind_count[t.kind] = by_kind_count.get(t.kind, 0) + 1
            torch_by_kind[t.kind] = torch_by_kind.get(t.kind, 0) + int(t.torch)
            peak_by_kind_process[t.kind] = max(peak_by_kind_process.get(t.kind, 0.0), round(t.peak_mb, 1))
        titles = sorted({ti for t in ray_workers for ti in t.titles if ti.startswith("ray::")})
        return {"peak_pss_mb": round(self.peak["total_mb"], 1), "by_kind_at_peak": self.peak["by_kind"],
                "processes_at_peak": self.peak["processes"], "samples": len(self.samples),
                "ray_worker_processes": len(ray_workers), "processes_by_kind": by_kind_count,
                "processes_with_torch_by_kind": torch_by_kind, "largest_process_mb_by_kind": peak_by_kind_process,
                "worker_titles": titles[:40]}


def _sampled(cmd: list[str], log_path: str, timeout_s: float, every_s: float) -> tuple[float, dict[str, Any]]:
    """Run ``cmd`` in its own session with its output in ``log_path``, sampling its process tree; returns the
    start time and {rc, wall_s, load_avg_1m, the sampler's summary}. Killed (with its tree) at ``timeout_s``."""
    load0 = load_avg()
    with open(log_path, "w") as log:
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        sampler = Sampler(proc.pid, every_s).start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc = proc.wait()
        wall = time.time() - t0
        sampler.stop()
    return t0, {"rc": rc, "wall_s": round(wall, 1), "load_avg_1m": [load0, load_avg()], **sampler.summary()}


def run_once(label: str, extra: list[str], storage: str, name: str, cache_dir: str, timeout_s: float,
             every_s: float = 0.5) -> dict[str, Any]:
    """One ``python app/run.py`` in a subprocess, sampled; its memory and start-up figures."""
    cmd = [sys.executable, "app/run.py", "--storage", storage, "--name", name, "--scaling.ray_address=local",
           f"--data.cache_dir={cache_dir}", f"--data.local_cache_dir={os.path.join(cache_dir, 'local')}", *extra]
    log_path = os.path.join(storage, f"{name}.log")
    os.makedirs(storage, exist_ok=True)
    note(f"{label}: {' '.join(cmd[1:])}")
    t0, out = _sampled(cmd, log_path, timeout_s, every_s)
    out = {"label": label, **out}
    run_dir = os.path.join(storage, name)
    try:
        from lightray.startup import FILE, breakdown

        with open(os.path.join(run_dir, FILE)) as f:
            startup_rec = json.load(f)
        events = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
        out.update(breakdown(startup_rec, events, origin=t0))
    except (OSError, ValueError, KeyError) as exc:
        out.update({"first_step_s": None, "phases_s": {}, "timing_error": repr(exc)})
    if out["rc"] != 0:
        with open(log_path) as f:
            out["log_tail"] = f.read()[-2000:]
    note(f"{label}: rc {out['rc']}, peak {out['peak_pss_mb']:.0f} MB {out['by_kind_at_peak']}, first step "
         f"{out.get('first_step_s')} s {out.get('phases_s')}, {out['ray_worker_processes']} Ray worker processes")
    return out


def measure_floor(timeout_s: float, root: str, workers: int, cpus_per_worker: float,
                  every_s: float = 0.5) -> dict[str, Any]:
    """A bare Ray Train run (``bench.ray_train_floor``) under the same sampler: Ray Train's own start-up and
    memory with lightray's worker count, CPUs per worker and local-cluster settings, but no data and no model."""
    os.makedirs(root, exist_ok=True)
    out_path = os.path.join(root, "floor.json")
    cmd = [sys.executable, "-m", "bench.ray_train_floor", "--workers", str(workers),
           "--cpus-per-worker", str(cpus_per_worker), "--out", out_path]
    note(f"floor: {' '.join(cmd[1:])}")
    t0, out = _sampled(cmd, os.path.join(root, "floor.log"), timeout_s, every_s)
    out = {"label": "ray_train_floor", **out}
    try:
        with open(out_path) as f:
            rec = json.load(f)
        out.update(first_step_s=round(rec["first_collective"] - t0, 2), phases_s=rec["phases_s"])
    except (OSError, ValueError, KeyError) as exc:
        out.update(first_step_s=None, phases_s={}, timing_error=repr(exc))
    note(f"floor: rc {out['rc']}, peak {out['peak_pss_mb']:.0f} MB {out['by_kind_at_peak']}, first collective "
         f"{out.get('first_step_s')} s {out.get('phases_s')}")
    return out


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return round(statistics.median(vals), 2) if vals else None


def _spread(xs: list[float | None]) -> list[float] | None:
    vals = [x for x in xs if x is not None]
    return [round(min(vals), 2), round(max(vals), 2)] if vals else None


def measure(extra: list[str], repeats: int, timeout_s: float, root: str, tag: str) -> dict[str, Any]:
    """``repeats`` x (cold run on a fresh cache, then a warm run on the cache it built)."""
    runs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    for i in range(repeats):
        base = os.path.join(root, f"{tag}{i}")
        cache = os.path.join(base, "cache")
        for kind in ("cold", "warm"):
            run = run_once(f"{tag} {kind} #{i + 1}", extra, os.path.join(base, f"storage_{kind}"), f"{tag}-{kind}",
                           cache, timeout_s)
            if run["rc"] != 0 and RAY_START_TIMEOUT in run.get("log_tail", ""):
                # Ray gives its raylet a fixed 30 s to register; on an oversubscribed machine it can miss that.
                # Nothing of the run started, so it is run again once, and the line says so.
                note(f"{run['label']}: Ray's node start timed out (machine load {load_avg()}); running it again")
                run = dict(run_once(f"{tag} {kind} #{i + 1}", extra, os.path.join(base, f"storage_{kind}_retry"),
                                    f"{tag}-{kind}", cache, timeout_s), retried_after="ray start timed out")
            runs[kind].append(run)
        shutil.rmtree(base, ignore_errors=True)
    all_runs = runs["cold"] + runs["warm"]
    peak_run = max(all_runs, key=lambda r: r["peak_pss_mb"])
    return {
        "ok": all(r["rc"] == 0 for r in all_runs),
        "peak_pss_mb": peak_run["peak_pss_mb"],
        "by_kind": peak_run["by_kind_at_peak"],
        "peak_pss_mb_spread": _spread([r["peak_pss_mb"] for r in all_runs]),
        "first_step_s": {k: _median([r["first_step_s"] for r in v]) for k, v in runs.items()},
        "first_step_s_spread": {k: _spread([r["first_step_s"] for r in v]) for k, v in runs.items()},
        "ray_worker_processes": {k: _median([r["ray_worker_processes"] for r in v]) for k, v in runs.items()},
        "runs": all_runs,
    }


def _floor(timeout_s: float, root: str, recipe: str) -> dict[str, Any]:
    from lightray.config import load_config

    cfg = load_config(recipe)
    return measure_floor(timeout_s, os.path.join(root, "floor"), cfg.worker_range()[1], cfg.scaling.cpus_per_worker)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.footprint", description=__doc__.split("\n")[0])
    p.add_argument("--smoke-only", action="store_true", help="only the --smoke-test run (fast; the test's size)")
    p.add_argument("--repeats", type=int, default=1, help="cold + warm pairs per size (default 1)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run before it is killed")
    p.add_argument("--keep", metavar="DIR", help="run in DIR and keep the runs' folders (default: a temp dir)")
    p.add_argument("--no-floor", action="store_true",
                   help="skip the bare Ray Train run that measures the floor under lightray's figures")
    args = p.parse_args(argv)
    machine = Machine()
    root = args.keep or tempfile.mkdtemp(prefix="lr_footprint_")
    try:
        smoke = measure(["--smoke-test"], args.repeats, args.timeout, root, "smoke")
        demo = None if args.smoke_only else measure([], args.repeats, args.timeout, root, "demo")
        floor = None if args.no_floor else _floor(args.timeout, root, "smoke" if args.smoke_only else "demo")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    main_m = demo or smoke
    figures = {
        "size": "smoke" if demo is None else "demo",
        "peak_pss_mb": main_m["peak_pss_mb"],
        "first_step_s": main_m["first_step_s"],
        "by_kind": main_m["by_kind"],
        "ray_worker_processes": main_m["ray_worker_processes"],
        "spread": {"peak_pss_mb": main_m["peak_pss_mb_spread"], "first_step_s": main_m["first_step_s_spread"]},
        "phases_s": {r["label"]: r.get("phases_s") for r in main_m["runs"]},
        "ok": main_m["ok"],
        "smoke": {k: v for k, v in smoke.items() if k != "runs"} if demo is not None else None,
        "runs": main_m["runs"] + (smoke["runs"] if demo is not None else []),
        "ray_train_floor": floor,
    }
    ratios = {
        "peak_goal_over_peak": ratio(GOALS["peak_pss_mb"], main_m["peak_pss_mb"]),
        "warm_goal_over_first_step": ratio(GOALS["first_step_warm_s"], main_m["first_step_s"]["warm"]),
        "cold_goal_over_first_step": ratio(GOALS["first_step_cold_s"], main_m["first_step_s"]["cold"]),
    }
    if floor is not None:
        # How much of lightray's warm start-up and peak memory is Ray Train's own, measured side by side.
        ratios["floor_over_first_step_warm"] = ratio(floor["first_step_s"], main_m["first_step_s"]["warm"])
        ratios["floor_over_peak_pss"] = ratio(floor["peak_pss_mb"], main_m["peak_pss_mb"])
    emit("footprint", figures, ratios, machine.finish(repeats=args.repeats, goals=GOALS))
    return 0 if main_m["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
