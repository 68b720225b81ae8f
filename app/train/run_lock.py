"""One driver per run: ``driver.lock`` in the run folder names the driver that owns the run.

Two drivers on one run name would both resume from the same checkpoint, both write checkpoints and
summary.json, and count the same samples twice. The lock file holds the owner's host, pid, start time
and a heartbeat that a thread refreshes while the driver lives. A second driver is refused while the
owner lives; a lock whose owner is gone is taken over with a warning:

- same host: the pid no longer runs (or runs a process started after the lock was taken: pid reuse);
- another host (the pid cannot be checked there): the heartbeat is older than ``stale_after_s``.

Object stores have no atomic create-if-absent, so taking the lock is write-then-read-back: after a
short pause the file must still carry this driver's token; of two drivers racing, the later write
wins and the other one is refused.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from app import storage

log = logging.getLogger("lightray")
LOCK_NAME = "driver.lock"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 60.0  # > several missed heartbeats: a slow object store must not look like a dead driver


class RunLockedError(FileExistsError):
    """Another live driver holds the run; the message names it (host, pid, start time)."""


@dataclass
class LockHolder:
    host: str
    pid: int
    start_time: float
    heartbeat: float
    token: str

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.start_time))
        return f"host {self.host}, pid {self.pid}, started {started}"


def read_holder(run_dir: str) -> LockHolder | None:
    """The lock's holder, or None when there is no lock (an unreadable lock counts as none)."""
    try:
        data = storage.read_json(storage.join(run_dir, LOCK_NAME))
        return LockHolder(str(data["host"]), int(data["pid"]), float(data["start_time"]),
                          float(data["heartbeat"]), str(data["token"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _pid_alive_since(pid: int, start_time: float) -> bool:
    """True when ``pid`` runs here and was started no later than ``start_time`` (else the pid was reused)."""
    import psutil

    try:
        return psutil.Process(pid).create_time() <= start_time + 1.0
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True


def holder_is_alive(holder: LockHolder, stale_after_s: float = STALE_AFTER_S, now: float | None = None) -> bool:
    if holder.host == socket.gethostname():
        return _pid_alive_since(holder.pid, holder.start_time)
    return (now if now is not None else time.time()) - holder.heartbeat < stale_after_s


class RunLock:
    """The lock of one run folder: ``acquire()`` (raises RunLockedError), then ``release()``."""

    def __init__(self, run_dir: str, *, heartbeat_s: float = HEARTBEAT_S, stale_after_s: float = STALE_AFTER_S,
                 settle_s: float = 0.2, pid: int | None = None):
        """``pid``: the process that stands for the driver (default this one; a guarded driver's guardian)."""
        self.run_dir, self.path = run_dir, storage.join(run_dir, LOCK_NAME)
        self.heartbeat_s, self.stale_after_s, self.settle_s = heartbeat_s, stale_after_s, settle_s
        self.me = LockHolder(socket.gethostname(), pid or os.getpid(), time.time(), time.time(), uuid.uuid4().hex)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self) -> None:
        self.me.heartbeat = time.time()
        storage.write_json(self.path, asdict(self.me))

    def _refuse(self, holder: LockHolder) -> RunLockedError:
        return RunLockedError(f"run {self.run_dir} is already being run by another driver ({holder.describe()}); "
                              f"stop it first, or wait: a lock whose driver is gone is taken over "
                              f"(lock file {self.path})")

    def acquire(self) -> RunLock:
        holder = read_holder(self.run_dir)
        if holder is not None and holder.token != self.me.token:
            if holder_is_alive(holder, self.stale_after_s):
                raise self._refuse(holder)
            age = time.time() - holder.heartbeat
            log.warning("taking over the run lock of a driver that is gone (%s, last heartbeat %.0f s ago)",
                        holder.describe(), age)
            print(f"lightray: warning: taking over run {self.run_dir} from a driver that is gone "
                  f"({holder.describe()})", flush=True)
        self._write()
        time.sleep(self.settle_s)
        now = read_holder(self.run_dir)
        if now is None or now.token != self.me.token:  # another driver wrote after us: it wins
            raise self._refuse(now or holder or self.me)
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._write()
            except OSError as exc:  # storage hiccup: the next beat tries again; stale_after_s spans several
                log.warning("run lock heartbeat failed: %s", exc)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this driver's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            holder = read_holder(self.run_dir)
            if holder is not None and holder.token == self.me.token:
                storage.remove(self.path)
        except OSError as exc:
            log.warning("could not remove the run lock %s: %s", self.path, exc)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

