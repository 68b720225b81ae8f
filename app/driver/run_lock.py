"""One driver per run: ``driver.lock`` in the run folder names the driver that owns the run.

Two drivers on one run name would both resume from the same checkpoint, both write checkpoints and
summary.json, and count the same samples twice. The lock file holds the owner's host, pid, start time
and a heartbeat that a thread refreshes while the driver lives. A second driver is refused while the
owner lives; a lock whose owner is gone is taken over with a warning:

- same host: the pid no longer runs (or runs a process started after the lock was taken: pid reuse);
- another host (the pid cannot be checked there): the heartbeat is older than ``stale_after_s``.

Taking, refreshing and removing the lock are compare-and-swap operations (app/driver/lock_store.py): a create
that fails when a lock is there (S3's ``If-None-Match: *``, a hard link on a disk), and a heartbeat, take-over
or release that acts only on the very lock this driver last saw (``If-Match``). Of two drivers started at the
same instant exactly one takes the run, and a driver whose lock was taken from it (its heartbeat stalled past
``stale_after_s``) finds out at its next heartbeat instead of writing over the new owner's lock.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from lightray import storage
from lightray.driver.lock_store import lock_store

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


def _parse(raw: bytes) -> LockHolder | None:
    try:
        data = json.loads(raw)
        return LockHolder(str(data["host"]), int(data["pid"]), float(data["start_time"]),
                          float(data["heartbeat"]), str(data["token"]))
    except (ValueError, KeyError, TypeError):
        return None


def read_holder(run_dir: str) -> LockHolder | None:
    """The lock's holder, or None when there is no lock (an unreadable lock counts as none)."""
    try:
        return _parse(storage.read_bytes(storage.join(run_dir, LOCK_NAME)))
    except OSError:
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
    """The lock of one run folder: ``acquire()`` (raises RunLockedError), then ``release()``. ``lost`` turns
    true when a heartbeat finds that another driver has taken the lock."""

    def __init__(self, run_dir: str, *, heartbeat_s: float = HEARTBEAT_S, stale_after_s: float = STALE_AFTER_S,
                 settle_s: float = 0.2, pid: int | None = None):
        """``pid``: the process that stands for the driver (default this one; a guarded driver's guardian).
        ``settle_s``: the read-back pause, only on object stores without conditional writes."""
        self.run_dir, self.path = run_dir, storage.join(run_dir, LOCK_NAME)
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.store = lock_store(self.path, settle_s)
        self.me = LockHolder(socket.gethostname(), pid or os.getpid(), time.time(), time.time(), uuid.uuid4().hex)
        self.tag: str | None = None
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _payload(self) -> bytes:
        self.me.heartbeat = time.time()
        return json.dumps(asdict(self.me)).encode()

    def _refuse(self, holder: LockHolder) -> RunLockedError:
        return RunLockedError(f"run {self.run_dir} is already being run by another driver ({holder.describe()}); "
                              f"stop it first, or wait: a lock whose driver is gone is taken over "
                              f"(lock file {self.path})")

    def acquire(self) -> RunLock:
        for _ in range(5):  # each pass ends, or sees the lock change under it and looks again
            tag = self.store.create(self._payload())
            if tag is None:
                seen = self.store.read()
                if seen is None:  # released between the two calls
                    continue
                holder = _parse(seen[0])
                if holder is not None and holder_is_alive(holder, self.stale_after_s):
                    raise self._refuse(holder)
                if holder is not None:
                    age = time.time() - holder.heartbeat
                    log.warning("taking over the run lock of a driver that is gone (%s, last heartbeat %.0f s ago)",
                                holder.describe(), age)
                    print(f"lightray: warning: taking over run {self.run_dir} from a driver that is gone "
                          f"({holder.describe()})", flush=True)
                tag = self.store.replace(self._payload(), seen[1])  # only if it is still the lock just judged
                if tag is None:
                    continue
            self.tag = tag
            break
        else:
            raise self._refuse(read_holder(self.run_dir) or self.me)
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                tag = self.store.replace(self._payload(), self.tag)
            except Exception as exc:  # storage hiccup: the next beat tries again; stale_after_s spans several
                log.warning("run lock heartbeat failed: %s", exc)
                continue
            if tag is None:
                self.lost = True
                holder = read_holder(self.run_dir)
                msg = (f"run {self.run_dir}: the run lock is no longer this driver's"
                       f"{f' ({holder.describe()} holds it)' if holder else ''}: its heartbeat stalled past "
                       f"{self.stale_after_s:g} s and another driver took the run over")
                log.error(msg)
                print(f"lightray: error: {msg}", flush=True)
                return
            self.tag = tag

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this driver's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.tag is None or self.lost:
            return
        try:
            self.store.delete(self.tag)
        except Exception as exc:
            log.warning("could not remove the run lock %s: %s", self.path, exc)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

