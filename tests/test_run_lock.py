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


def _holder_process(run_dir: pathlib.Path, host: str | None = None, clock_offset_s: float = 0.0) -> subprocess.Popen:
    """A real process that takes the run lock and then sleeps (until killed), beating every 0.5 s; with ``host``
    it stands for a driver on another host whose wall clock is ``clock_offset_s`` off this one's."""
    script = textwrap.dedent(f"""
        import time
        from lightray.driver.run_lock import RunLock
        RunLock({str(run_dir)!r}, heartbeat_s=0.5, host={host!r},
                clock=lambda: time.time() + {clock_offset_s!r}).acquire()
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


def test_another_hosts_lock_is_judged_by_its_heartbeat_count_not_by_comparing_clocks(tmp_path):
    """Staleness is the holder's own heartbeat count standing still for stale_after_s of this host's clock: a live
    holder whose clock is an hour behind keeps the run; a dead one whose clock was an hour ahead loses it."""
    behind = _holder_process(tmp_path / "a", host="another-node", clock_offset_s=-3600)
    try:
        with pytest.raises(RunLockedError, match="host another-node, pid"):
            RunLock(str(tmp_path / "a"), stale_after_s=2).acquire()
    finally:
        behind.kill()
        behind.wait()
    ahead = _holder_process(tmp_path / "b", host="another-node", clock_offset_s=3600)
    ahead.kill()
    ahead.wait()
    assert read_holder(str(tmp_path / "b")).heartbeat > time.time() + 3000  # its last beat, "in the future"
    with RunLock(str(tmp_path / "b"), stale_after_s=2, on_lost=pytest.fail):
        assert read_holder(str(tmp_path / "b")).host == socket.gethostname()


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
    # Separate interpreters, as separate drivers are. Not forks of this one: a pytest worker may hold Ray's threads
    # (the session cluster, a Ray Data execution), and a fork copies their locks mid-use (a CI run's forked
    # contender died of SIGSEGV in Ray's signal handler, 2026-12-06).
    ctx = multiprocessing.get_context("spawn")
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
def test_a_heartbeat_that_finds_its_lock_taken_leaves_the_new_owners_lock_alone(where, tmp_path, request):
    base = str(tmp_path) if where == "local" else request.getfixturevalue("s3_storage")
    lost: list[str] = []
    lock = RunLock(base, heartbeat_s=0.2, on_lost=lost.append).acquire()  # the default ends the process
    try:
        # Another driver took the run over (this one's heartbeat had stalled past stale_after_s).
        now = time.time()
        storage.write_json(storage.join(base, LOCK_NAME), {"host": "another-node", "pid": 7, "start_time": now,
                                                           "heartbeat": now, "token": "theirs"})
        # The next heartbeat (every 0.2 s) finds the lock changed under it; one that wrote over it never would.
        wait_for(lambda: lost, 60, "the heartbeat to find its lock taken", interval=0.05)
        assert lock.lost and read_holder(base).token == "theirs"  # no heartbeat wrote over it
    finally:
        lock.release()
    (msg,) = lost  # said once, naming the new holder (tests/test_driver_guard.py: the process then ends)
    assert "another driver took the run over (host another-node, pid 7" in msg, msg
    assert read_holder(base).token == "theirs"  # nor did the release remove it


@pytest.fixture
def s3_proxy(s3_storage):
    from urllib.parse import parse_qs, urlsplit

    from tests.s3_proxy import S3Proxy

    host, port = parse_qs(urlsplit(s3_storage).query)["endpoint_override"][0].rsplit(":", 1)
    proxy = S3Proxy(host, int(port))
    yield proxy
    proxy.close()


def test_a_conditional_write_retried_after_its_reply_was_lost_is_not_a_loss(s3_proxy, capsys):
    """The server applies a conditional PUT and its reply is lost; botocore retries it and gets 412, because
    the lock is now the one it wrote. Neither taking the lock nor a heartbeat may read that as another driver's."""
    base = s3_proxy.uri("lightray-runs/runs/retried")
    s3_proxy.lose_conditional_put_replies = 1  # the create (If-None-Match: *)
    lost: list[str] = []
    lock = RunLock(base, heartbeat_s=0.2, on_lost=lost.append).acquire()
    try:
        assert read_holder(base).token == lock.me.token
        s3_proxy.lose_conditional_put_replies = 2  # two heartbeats in a row (If-Match)
        beats = lock.me.beats
        wait_for(lambda: len(s3_proxy.lost) == 3 and lock.me.beats >= beats + 4, 60,
                 "two heartbeats whose replies were lost, and two more", interval=0.05)
        assert lost == [] and not lock.lost
        assert read_holder(base).beats >= beats + 3  # the heartbeat goes on writing
    finally:
        lock.release()
    assert [line.split(b" ")[0] for line in s3_proxy.lost] == [b"PUT"] * 3
    assert read_holder(base) is None  # released as its own
    assert "warning" not in capsys.readouterr().out


def test_a_store_that_ignores_conditional_writes_is_named_in_a_warning(s3_proxy, capsys):
    s3_proxy.strip_conditions = True  # an S3-compatible store without conditional writes
    base = s3_proxy.uri("lightray-runs/runs/unconditional")
    with RunLock(base, on_lost=pytest.fail):
        pass
    out = capsys.readouterr().out
    assert "lightray: warning: the object store of s3://lightray-runs/runs/unconditional/driver.lock" in out, out
    assert "ignored a conditional write" in out and "two drivers could both take this run" in out, out
    s3_proxy.strip_conditions = False
    with RunLock(s3_proxy.uri("lightray-runs/runs/conditional"), on_lost=pytest.fail):
        assert "ignored a conditional write" not in capsys.readouterr().out


# Two real drivers of one run started at the same instant on S3, one refused by the lock's conditional create:
# tests/test_s3_runs.py, in its stop-and-resume run.
