"""One driver per run: ``driver.lock`` in the run folder names the driver that owns the run.

Two drivers on one run name would both resume from the same checkpoint, both write checkpoints and
summary.json, and count the same samples twice. The lock file holds the owner's host, pid, start time, a
random token and a heartbeat count that a thread advances while the driver lives. A second driver is refused
while the owner lives; a lock whose owner is gone is taken over with a warning:

- same host: the pid no longer runs (or runs a process started after the lock was taken: pid reuse);
- another host (the pid cannot be checked there): its heartbeat count did not move for ``stale_after_s`` of
  this host's own clock. Two hosts' wall clocks are never compared.

Taking, refreshing and removing the lock are compare-and-swap operations (app/driver/lock_store.py): a create
that fails when a lock is there (S3's ``If-None-Match: *``, a hard link on a disk), and a heartbeat, take-over
or release that acts only on the very lock this driver last saw (``If-Match``). A refused write that finds this
driver's own token in the lock was this driver's (a request retried after its reply was lost), not a loss.

The lock is a fence: a driver whose heartbeat finds the lock taken from it prints one line naming the new
holder and ends its process at once (``EXIT_LOCK_LOST``), so it writes no further checkpoint, record, bill or
summary beside the new owner; Ray ends its worker group with it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from lightray import storage
from lightray.driver.lock_store import lock_store

log = logging.getLogger("lightray")
LOCK_NAME = "driver.lock"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 60.0  # > several missed heartbeats: a slow object store must not look like a dead driver
EXIT_LOCK_LOST = 4  # the exit status of a driver whose run another driver took over


class RunLockedError(FileExistsError):
    """Another live driver holds the run; the message names it (host, pid, start time)."""


@dataclass
class LockHolder:
    host: str
    pid: int
    start_time: float
    heartbeat: float  # wall-clock time of the last beat, for people to read; never compared across hosts
    token: str
    beats: int = 0  # advanced at every heartbeat: how another host tells a live holder from a dead one

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.start_time))
        return f"host {self.host}, pid {self.pid}, started {started}"


def _parse(raw: bytes) -> LockHolder | None:
    try:
        data = json.loads(raw)
        return LockHolder(str(data["host"]), int(data["pid"]), float(data["start_time"]),
                          float(data["heartbeat"]), str(data["token"]), int(data.get("beats", 0)))
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


def exit_on_lost_lock(message: str) -> None:
    """The fence: one line naming the new holder, then the process ends with ``EXIT_LOCK_LOST``. Not
    ``sys.exit``: this runs on the heartbeat thread while the main thread is inside Ray, and nothing of this
    driver (no ``finally``, no summary, no last copy of the records) may write after the run stopped being its."""
    print(f"lightray: error: {message}; this driver stopped without writing more", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_LOCK_LOST)


class RunLock:
    """The lock of one run folder: ``acquire()`` (raises RunLockedError), then ``release()``. When a heartbeat
    finds that another driver has taken the lock, ``lost`` turns true and ``on_lost`` is called with one line
    naming the holder (default: ``exit_on_lost_lock``, which ends the process)."""

    def __init__(self, run_dir: str, *, heartbeat_s: float = HEARTBEAT_S, stale_after_s: float = STALE_AFTER_S,
                 settle_s: float = 0.2, pid: int | None = None, on_lost: Callable[[str], None] | None = None,
                 host: str | None = None, clock: Callable[[], float] = time.time):
        """``pid``: the process that stands for the driver (default this one; a guarded driver's guardian).
        ``settle_s``: the read-back pause, only on object stores without conditional writes. ``host`` and
        ``clock``: what the lock says of this driver (default this host's name and wall clock)."""
        self.run_dir, self.path = run_dir, storage.join(run_dir, LOCK_NAME)
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.store = lock_store(self.path, settle_s)
        self.clock = clock
        self.on_lost = on_lost or exit_on_lost_lock
        self.me = LockHolder(host or socket.gethostname(), pid or os.getpid(), clock(), clock(), uuid.uuid4().hex)
        self.tag: str | None = None
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _payload(self) -> bytes:
        self.me.heartbeat = self.clock()
        return json.dumps(asdict(self.me)).encode()

    def _mine(self, seen: tuple[bytes, str] | None) -> bool:
        holder = _parse(seen[0]) if seen is not None else None
        return holder is not None and holder.token == self.me.token

    def _create(self, data: bytes) -> str | None:
        tag = self.store.create(data)
        if tag is None:  # a create retried after its reply was lost finds the lock it made
            seen = self.store.read()
            if self._mine(seen) and seen[0] == data:
                return seen[1]
        return tag

    def _replace(self, data: bytes, tag: str) -> str | None:
        new = self.store.replace(data, tag)
        if new is None:
            seen = self.store.read()
            if self._mine(seen):  # an earlier write of this driver's landed after all (its reply was lost)
                return seen[1] if seen[0] == data else self.store.replace(data, seen[1])
        return new

    def _refuse(self, holder: LockHolder) -> RunLockedError:
        return RunLockedError(f"run {self.run_dir} is already being run by another driver ({holder.describe()}); "
                              f"stop it first, or wait: a lock whose driver is gone is taken over "
                              f"(lock file {self.path})")

    def _watch(self, seen: tuple[bytes, str], holder: LockHolder) -> tuple[str, tuple[bytes, str] | None]:
        """Another host's lock, watched for ``stale_after_s`` of this host's clock: ("alive", _) when its
        heartbeat count moves, ("changed", _) when it went away or changed hands, else ("stale", the lock)."""
        print(f"lightray: run {self.run_dir} is locked by {holder.describe()}; waiting up to "
              f"{self.stale_after_s:g} s for its heartbeat", flush=True)
        deadline = time.monotonic() + self.stale_after_s
        every = max(0.05, min(self.heartbeat_s, self.stale_after_s / 6))
        while time.monotonic() < deadline:
            time.sleep(min(every, max(0.0, deadline - time.monotonic())))
            now = self.store.read()
            now_holder = _parse(now[0]) if now is not None else None
            if now_holder is None or now_holder.token != holder.token:
                return "changed", now
            if now_holder.beats != holder.beats:
                return "alive", now
            seen = now
        return "stale", seen

    def acquire(self) -> RunLock:
        for _ in range(5):  # each pass ends, or sees the lock change under it and looks again
            data = self._payload()
            tag = self._create(data)
            if tag is None:
                seen = self.store.read()
                if seen is None:  # released between the two calls
                    continue
                holder = _parse(seen[0])
                if holder is not None and holder.host == self.me.host:
                    if _pid_alive_since(holder.pid, holder.start_time):
                        raise self._refuse(holder)
                elif holder is not None:
                    verdict, seen = self._watch(seen, holder)
                    if verdict == "alive":
                        raise self._refuse(holder)
                    if verdict == "changed":
                        continue
                if holder is not None:
                    log.warning("taking over the run lock of a driver that is gone (%s, %d heartbeats)",
                                holder.describe(), holder.beats)
                    print(f"lightray: warning: taking over run {self.run_dir} from a driver that is gone "
                          f"({holder.describe()})", flush=True)
                data = self._payload()
                tag = self._replace(data, seen[1])  # only if it is still the lock just judged
                if tag is None:
                    continue
            self.tag = tag
            break
        else:
            raise self._refuse(read_holder(self.run_dir) or self.me)
        if not self.store.keeps_conditions(data):
            msg = (f"the object store of {self.path} ignored a conditional write (If-None-Match), so two "
                   "drivers could both take this run and the later one's writes win; start one driver per run")
            log.warning(msg)
            print(f"lightray: warning: {msg}", flush=True)
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.me.beats += 1
            try:
                tag = self._replace(self._payload(), self.tag)
            except Exception as exc:  # storage hiccup: the next beat tries again; stale_after_s spans several
                log.warning("run lock heartbeat failed: %s", exc)
                continue
            if tag is None:
                self.lost = True
                holder = read_holder(self.run_dir)
                msg = (f"run {self.run_dir}: another driver took the run over"
                       f"{f' ({holder.describe()} holds it)' if holder else ''}; this driver's heartbeat had "
                       f"stalled past {self.stale_after_s:g} s")
                log.error(msg)
                if not self._stop.is_set():  # a release already under way has nothing left to stop
                    self.on_lost(msg)
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

