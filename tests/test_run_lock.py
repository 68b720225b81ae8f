"""One driver per run: the lock file in the run folder, with real processes (live, killed, another host)."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from lightray import storage
from lightray.driver.run_lock import LOCK_NAME, RunLock, RunLockedError, read_holder
from tests.faults import wait_for

ROOT = pathlib.Path(__file__).parents[1]


def _holder_process(run_dir: pathlib.Path) -> subprocess.Popen:
    """A real process that takes the run lock and then sleeps (until killed)."""
    script = textwrap.dedent(f"""
        import time
        from lightray.driver.run_lock import RunLock
        RunLock({str(run_dir)!r}, heartbeat_s=0.5).acquire()
        print("locked", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_live_driver_keeps_the_run_and_the_refusal_names_it(tmp_path):
    proc = _holder_process(tmp_path)
    try:
        with pytest.raises(RunLockedError) as err:
            RunLock(str(tmp_path)).acquire()
        msg = str(err.value)
        assert f"pid {proc.pid}" in msg and f"host {socket.gethostname()}" in msg and "started " in msg
        # The holder's heartbeat (every 0.5 s) moves on while it lives.
        first = read_holder(str(tmp_path)).heartbeat
        wait_for(lambda: read_holder(str(tmp_path)).heartbeat > first, 60, "the holder's heartbeat to move on",
                 interval=0.05)
    finally:
        proc.kill()
        proc.wait()


def test_a_lock_left_by_a_killed_driver_is_taken_over(tmp_path, capsys):
    proc = _holder_process(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert read_holder(str(tmp_path)).pid == proc.pid  # the dead driver's lock is still there
    lock = RunLock(str(tmp_path)).acquire()
    try:
        assert read_holder(str(tmp_path)).pid == os.getpid()
        assert f"pid {proc.pid}" in capsys.readouterr().out  # the take-over is announced
    finally:
        lock.release()
    assert not (tmp_path / LOCK_NAME).exists()  # released on a clean exit


def _other_host_lock(run_dir: pathlib.Path, heartbeat_age_s: float) -> None:
    now = time.time()
    storage.write_json(str(run_dir / LOCK_NAME), {"host": "another-node", "pid": 1, "start_time": now - 3600,
                                                  "heartbeat": now - heartbeat_age_s, "token": "x"})


def test_another_hosts_lock_counts_while_its_heartbeat_is_fresh(tmp_path):
    _other_host_lock(tmp_path, heartbeat_age_s=1)
    with pytest.raises(RunLockedError, match="host another-node, pid 1"):
        RunLock(str(tmp_path), stale_after_s=30).acquire()
    _other_host_lock(tmp_path, heartbeat_age_s=120)
    with RunLock(str(tmp_path), stale_after_s=30):
        assert read_holder(str(tmp_path)).host == socket.gethostname()


def _race(run_dir: str, barrier, results, release) -> None:
    """One of several drivers taking the same run at the same instant: puts (pid, "held" or the refusal's
    message) on ``results``; a holder keeps the run until the test sets ``release``, then says "released"."""
    lock = RunLock(run_dir, heartbeat_s=60)
    barrier.wait(timeout=60)
    try:
        lock.acquire()
    except RunLockedError as exc:
        results.put((os.getpid(), str(exc)))
        return
    results.put((os.getpid(), "held"))
    release.wait(timeout=60)
    lock.release()
    results.put((os.getpid(), "released"))


@pytest.mark.parametrize("where", ["local", "s3"])
def test_drivers_started_at_the_same_instant_leave_exactly_one_holder(where, tmp_path, request):
    import multiprocessing

    base = str(tmp_path) if where == "local" else request.getfixturevalue("s3_storage")
    ctx = multiprocessing.get_context("fork")  # separate processes, as separate drivers are
    for round_ in range(3):
        run_dir = storage.join(base, f"race{round_}")
        barrier, results, release = ctx.Barrier(5), ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=_race, args=(run_dir, barrier, results, release)) for _ in range(5)]
        for p in procs:
            p.start()
        try:
            # Every contender answers while the holder still holds the run (it lets go only when told below), so
            # a refusal cannot be a late look at a lock already released, nor a second holder a late taker.
            got = dict(results.get(timeout=60) for _ in procs)
            holders = [pid for pid, g in got.items() if g == "held"]
            assert len(holders) == 1, got
            refusal = f"already being run by another driver (host {socket.gethostname()}, pid {holders[0]},"
            assert all(refusal in g for pid, g in got.items() if pid != holders[0]), got
            assert read_holder(run_dir).pid == holders[0]
            release.set()
            assert results.get(timeout=60) == (holders[0], "released")
        finally:
            release.set()
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        assert read_holder(run_dir) is None  # the holder released it


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_heartbeat_that_finds_its_lock_taken_leaves_the_new_owners_lock_alone(where, tmp_path, request, capsys):
    base = str(tmp_path) if where == "local" else request.getfixturevalue("s3_storage")
    lock = RunLock(base, heartbeat_s=0.2).acquire()
    try:
        # Another driver took the run over (this one's heartbeat had stalled past stale_after_s).
        now = time.time()
        storage.write_json(storage.join(base, LOCK_NAME), {"host": "another-node", "pid": 7, "start_time": now,
                                                           "heartbeat": now, "token": "theirs"})
        # The next heartbeat (every 0.2 s) finds the lock changed under it; one that wrote over it never would.
        wait_for(lambda: lock.lost, 60, "the heartbeat to find its lock taken", interval=0.05)
        assert read_holder(base).token == "theirs"  # no heartbeat wrote over it
    finally:
        lock.release()  # joins the heartbeat thread, which said so before it ended
    assert "no longer this driver's (host another-node, pid 7" in capsys.readouterr().out
    assert read_holder(base).token == "theirs"  # nor did the release remove it


# Two real drivers of one run started at the same instant on S3, one refused by the lock's conditional create:
# tests/test_s3_runs.py, in its stop-and-resume run.
