"""Helpers shared by the side-by-side benchmarks: the machine's evidence and the one JSON line.

Every ``python -m bench.<name>`` prints exactly one line on stdout,
``{"bench": NAME, "figures": {...}, "ratios": {...}, "machine": {...}}``; everything else (progress,
Ray's logs) goes to stderr so that the line can be piped straight into a results file.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import sys
import time
from collections import defaultdict
from typing import Any, TextIO

import psutil

from lightray.provenance import git_revision
from lightray.storage import read_jsonl  # noqa: F401  (re-exported: benches and tests read run logs)

REPO = pathlib.Path(__file__).resolve().parents[1]


def load_avg() -> float:
    """The 1-minute load average (the machine is shared: figures mean little without it)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return -1.0


def memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return -1.0


class Machine:
    """Collects the ``machine`` section: take one at the start of a bench, ``finish()`` it at the end."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.load_start = load_avg()

    def finish(self, argv: list[str] | None = None, **extra: Any) -> dict[str, Any]:
        """The section; ``argv`` is the bench's arguments when ``main(argv)`` was called in-process (default:
        this process's own), ``extra`` the bench's own fields (they win over the common ones)."""
        import torch

        try:
            import ray

            ray_version = ray.__version__
        except ImportError:
            ray_version = "absent"
        args = sys.argv[1:] if argv is None else argv
        return {"cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                "cpu_count": os.cpu_count(), "memory_gib": memory_gib(), "load_avg_1m_at_start": self.load_start,
                "load_avg_1m_at_end": load_avg(), "torch": torch.__version__, "ray": ray_version,
                "python": platform.python_version(), "platform": platform.platform(), "git": git_revision(short=12),
                "command": " ".join(["python", "-m", module_name(sys.argv[0]), *args]),
                "bench_wall_s": round(time.time() - self.t0, 1), **extra}


def module_name(argv0: str) -> str:
    """``bench/overhead.py`` (what ``-m`` leaves in argv[0]) -> ``bench.overhead``."""
    p = pathlib.Path(argv0)
    try:
        p = p.resolve().relative_to(REPO)
    except ValueError:
        return argv0
    return ".".join(p.with_suffix("").parts)


def emit(bench: str, figures: dict[str, Any], ratios: dict[str, Any], machine: dict[str, Any],
         out: TextIO | None = None) -> dict[str, Any]:
    """Print the bench's one JSON line on ``out`` (default: stdout), flushed, and return it."""
    line = {"bench": bench, "figures": figures, "ratios": ratios, "machine": machine}
    out = out or sys.stdout
    out.write(json.dumps(line) + "\n")
    out.flush()
    return line


def note(message: str) -> None:
    """Progress for the person watching: stderr, never stdout (stdout holds only the JSON line)."""
    sys.stderr.write(f"[bench {time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return round(num / den, 4)


def process_tree(pid: int) -> list[psutil.Process]:
    """Every live process below ``pid`` (not ``pid`` itself), zombies left out: what there is left to kill or
    measure. Empty when ``pid`` is gone."""
    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for proc in below:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.NoSuchProcess:
            continue
    return out


def kill_processes(procs: list[psutil.Process]) -> None:
    """SIGKILL each process that is still there (one that has already gone is skipped)."""
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue


def stopped_process_ended(pid: int) -> bool:
    """Whether a worker the bench stopped (SIGSTOP) is gone, or a zombie, after its run moved on; one still there
    is killed, not left stopped (it would hold its machine's GPU)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return True
        proc.kill()
        return False
    except psutil.NoSuchProcess:
        return True


def stop_processes(procs: list[psutil.Process], grace_s: float = 10.0) -> None:
    """SIGTERM each process (as ``ray stop`` does), then SIGKILL whatever is left after ``grace_s``."""
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


def json_stdout() -> TextIO:
    """A stream on the original stdout for the bench's one JSON line; fd 1 itself then goes to stderr, since Ray's
    driver prints (node deaths, worker logs) to stdout from background threads."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return out


def tree_pss_mb(pid: int) -> float:
    """Proportional set size of ``pid`` and every process below it, in MB: shared pages are split among the
    processes sharing them, so forked workers are not counted several times."""
    total = 0
    for proc in [psutil.Process(pid), *process_tree(pid)]:
        try:
            total += proc.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total / 2**20


def spread(values: list[float | None], digits: int = 4) -> dict[str, Any]:
    """Median, min and max of repeated measurements (``None``s, i.e. runs that produced no figure, are counted
    in ``missing`` and left out of the statistics), with every run kept: a reader judges the spread, not just
    the middle. All ``None`` when no run produced a figure."""
    got = sorted(float(v) for v in values if v is not None)
    mid = None
    if got:
        k = len(got) // 2
        mid = got[k] if len(got) % 2 else (got[k - 1] + got[k]) / 2

    def r(v: float | None) -> float | None:
        return None if v is None else round(v, digits)

    return {"median": r(mid), "min": r(got[0] if got else None), "max": r(got[-1] if got else None),
            "n": len(got), "missing": len(values) - len(got), "runs": [r(v) for v in values]}


def resolved_ratio(ratios: list[float], digits: int = 4) -> dict[str, Any]:
    """A ratio measured in several A/B pairs, judged against 1 (no difference).

    ``gap`` is how far the median ratio lies from 1, ``spread`` the max minus the min over the pairs;
    ``resolved`` is false when the spread is wider than the gap: the pairs disagree by more than the
    difference being claimed, so the machine cannot tell the two sides apart at this load. One pair has no
    spread to judge by, so it is never resolved."""
    s = spread(list(ratios), digits)
    if s["median"] is None:
        return {**s, "gap": None, "spread": None, "resolved": False}
    gap, width = abs(s["median"] - 1.0), s["max"] - s["min"]
    known = sum(r is not None for r in ratios) >= 2
    return {**s, "gap": round(gap, digits), "spread": round(width, digits), "resolved": bool(known and width <= gap)}


def pin_threads(threads: int) -> int:
    """Set torch's intra-op threads (and the env that BLAS/OpenMP libraries started later read) to ``threads``;
    returns what torch now uses. Both sides of a comparison call this with the same number."""
    import torch

    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    torch.set_num_threads(threads)
    return torch.get_num_threads()


def machine_cores() -> int:
    """CPUs this process may run on (the affinity mask, else the count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# Ray names a worker process after what it runs ("ray::RayTrainWorker...", "ray::MapBatches(...)"); the cluster's
# daemons keep their program's name. First match wins.
PROCESS_KINDS = (
    ("train_workers", ("RayTrainWorker",)),
    ("train_controller", ("TrainController", "Controller")),
    ("ray_data_tasks", ("MapBatches", "_map_task", "ReadRange", "SplitCoordinator", "Map(", "StreamSplit")),
    ("run_log_actor", ("RunLog",)),
    ("idle_ray_workers", ("ray::IDLE",)),
    ("ray_daemons", ("raylet", "gcs_server", "dashboard", "Dashboard", "log_monitor", "autoscaler", "runtime_env",
                     "RuntimeEnvAgent", "monitor.py")),
    ("other_ray_workers", ("ray::",)),
)


def process_kind(proc: psutil.Process) -> str:
    """What a process of a local Ray cluster is (``PROCESS_KINDS``), from its name and command line."""
    try:
        text = proc.name() + " " + " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone"
    if "default_worker.py" in text:  # a worker before Ray retitles it; its arguments name the raylet and the rest
        return "other_ray_workers"
    for kind, marks in PROCESS_KINDS:
        if any(m in text for m in marks):
            return kind
    return "other"


class CpuSampler:
    """CPU-seconds of every process below ``pid`` (and ``pid`` itself), by kind, sampled every ``every_s`` in a
    thread; ``cores_by_kind(t0, t1)`` is how many cores each kind kept busy between two wall-clock times."""

    def __init__(self, pid: int, every_s: float = 0.5):
        import threading

        self.pid, self.every_s = pid, every_s
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []  # (time, pid -> (kind, CPU-s))
        self._kinds: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        try:
            procs = [psutil.Process(self.pid), *psutil.Process(self.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        now: dict[int, tuple[str, float]] = {}
        for proc in procs:
            try:
                kind = self._kinds.get(proc.pid)
                if kind in (None, "idle_ray_workers", "other_ray_workers"):
                    kind = process_kind(proc)  # a pooled worker takes a task's name when it starts one
                self._kinds[proc.pid] = kind
                t = proc.cpu_times()
                now[proc.pid] = (kind, t.user + t.system)
            except psutil.NoSuchProcess:
                continue
        self.samples.append((time.time(), now))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.every_s)

    def cores_by_kind(self, t0: float, t1: float) -> dict[str, float]:
        """Mean cores busy per kind over the samples inside [t0, t1] (a process's CPU counted under the kind it
        had at the window's end; processes that started inside the window count from zero)."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return {}
        (ta, a), (tb, b) = inside[0], inside[-1]
        out: dict[str, float] = defaultdict(float)
        for pid, (kind, cpu) in b.items():
            before = a[pid][1] if pid in a else 0.0
            out[kind] += max(0.0, cpu - before) / (tb - ta)
        return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}
