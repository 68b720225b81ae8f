"""The Ray cluster going away under a running driver: notice it, say so, leave a run that can be resumed.

When the GCS of the cluster a driver joined stops (another program ran ``ray stop``, the head machine went
down), Ray's core worker in the driver retries for ``gcs_rpc_server_reconnect_timeout_s`` (60 s by default)
and then ends the process from C++: no exception reaches Python, so no summary.json is written and the
user sees nothing after Ray's own log lines. ``ClusterWatch`` probes the GCS port from a thread of its own
and, once it has been unreachable for ``grace_s`` (well inside Ray's window), calls ``on_lost``. The
runner's handler writes summary.json (status failed, the cause), prints one line that says the cluster was
lost and the command that continues the run, and exits with ``EXIT_CLUSTER_LOST``.

The probe is a plain TCP connect, not a Ray call: every Ray call may block until Ray itself gives up.
"""

from __future__ import annotations

import logging
import os
import shlex
import socket
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("lightray")

EXIT_CLUSTER_LOST = 3
# Ray's own limit on a lost GCS (the driver process is ended after it); RAY_gcs_rpc_server_reconnect_timeout_s
# changes it, so the grace below follows it.
_RAY_GCS_TIMEOUT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"


class ClusterLostError(RuntimeError):
    """The Ray cluster of the run stopped answering mid-run."""


def default_grace_s() -> float:
    """Seconds of an unreachable GCS before the run counts the cluster as lost: at most 20, and at most half
    of Ray's own reconnect limit, so that the handler always runs before Ray ends the process. A GCS that
    restarts within this time (a fault-tolerant head) is not counted as lost."""
    try:
        ray_limit = float(os.environ.get(_RAY_GCS_TIMEOUT_ENV, "60"))
    except ValueError:
        ray_limit = 60.0
    return max(2.0, min(20.0, ray_limit / 2))


def gcs_reachable(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts TCP connections at the GCS address ``host:port``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


class ClusterWatch:
    """Probes the GCS every ``every_s``; calls ``on_lost(cause)`` once it has been unreachable ``grace_s``.

    ``stop()`` ends the watch; it waits for a loss handler that already started (which ends the process), so
    that a normal end and a loss never both write the run's summary."""

    def __init__(self, gcs_address: str, on_lost: Callable[[str], None], *, every_s: float = 1.0,
                 grace_s: float | None = None):
        self.address = gcs_address
        self.on_lost = on_lost
        self.every_s = every_s
        self.grace_s = default_grace_s() if grace_s is None else grace_s
        self._stop = threading.Event()
        self._handling = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> ClusterWatch:
        self._thread = threading.Thread(target=self._loop, name="cluster-watch", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        last_ok = time.time()
        while not self._stop.wait(self.every_s):
            if gcs_reachable(self.address):
                last_ok = time.time()
                continue
            down_s = time.time() - last_ok
            if down_s < self.grace_s:
                continue
            with self._handling:
                if self._stop.is_set():
                    return
                cause = (f"the Ray cluster at {self.address} was lost: its GCS has not answered for "
                         f"{down_s:.0f} s (the cluster was stopped or its head node went down)")
                log.error(cause)
                self.on_lost(cause)
            return

    def stop(self) -> None:
        with self._handling:
            self._stop.set()


def resume_command(name: str, storage: str, argv: list[str] | None = None, *, tune: bool = False) -> str:
    """The command line that continues run ``name`` in ``storage`` (with ``tune``, that search): the driver's
    own flags (when it was started as ``app/run.py`` or ``lightray``) with ``--name``, ``--storage`` and
    ``--resume`` pinned, so that it resumes from any working directory."""
    argv = list(sys.argv if argv is None else argv)
    prog, args = (argv[0], argv[1:]) if argv else ("", [])
    if not (prog.endswith("run.py") or os.path.basename(prog) == "lightray"):
        # started from a bench or a notebook: the plain command
        prog, args = "app/run.py", ["--tune"] if tune else []
    kept: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("--name", "--storage"):
            skip = True
            continue
        if a == "--resume" or a.startswith(("--name=", "--storage=")):
            continue
        kept.append(a)
    head = ["python", prog] if prog.endswith(".py") else [prog]
    return shlex.join([*head, *kept, "--name", name, "--storage", storage, "--resume"])


def _disconnect_ray(timeout_s: float = 15.0) -> None:
    """Drop this process's Ray connection, so that writing the summary asks the gone cluster nothing (a Ray
    call now would block until Ray ends the process). Bounded: the exit must come before Ray's limit."""
    import ray

    done = threading.Thread(target=ray.shutdown, name="ray-shutdown", daemon=True)
    done.start()
    done.join(timeout_s)
    if done.is_alive():
        log.warning("Ray did not shut down within %.0f s after the cluster was lost", timeout_s)


def report_and_exit(cause: str, name: str, storage: str, write_summary: Callable[[ClusterLostError], None],
                    stream=None) -> None:
    """The end of a run whose cluster is gone: summary.json (status failed, the cause), one line saying so,
    the command that continues the run, exit status ``EXIT_CLUSTER_LOST``. Never returns."""
    stream = stream or sys.stderr
    _disconnect_ray()
    try:
        write_summary(ClusterLostError(cause))
    except Exception as exc:  # the line and the resume command must still come out
        log.error("could not write summary.json after the cluster was lost: %s", exc)
    announce_stop(cause, name, storage, stream)
    # Not sys.exit: this runs on the watch thread while the main thread is blocked inside Ray, which would
    # end the process from C++ a little later anyway.
    os._exit(EXIT_CLUSTER_LOST)


def announce_stop(cause: str, name: str, storage: str, stream=None, *, tune: bool = False) -> None:
    """The two lines that end a run (with ``tune``, a search) stopped from outside: what happened, and the
    command that continues it."""
    stream = stream or sys.stderr
    what = "the search stopped (its finished trials are kept)" if tune else \
        "the run stopped (summary.json: status failed)"
    where = "where it stopped" if tune else "its last checkpoint"
    print(f"lightray: error: {cause}; {what}", file=stream, flush=True)
    print(f"lightray: continue it from {where} with: {resume_command(name, storage, tune=tune)}",
          file=stream, flush=True)
    sys.stdout.flush()
