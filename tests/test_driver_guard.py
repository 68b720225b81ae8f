"""The driver's guardian (app/driver/guard.py) with real processes: a program forks its driver through
``driver_guard.guard()``, the driver tells the guardian its run and then ends the way Ray, a signal or Python
would end it. The "cluster" is a TCP port this test listens on, standing for the GCS the guardian probes; the
real Ray case (a head whose raylet stops first) is in tests/test_cluster_loss.py."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from lightray.driver.cluster_loss import EXIT_CLUSTER_LOST
from lightray.driver.run_lock import EXIT_LOCK_LOST, LOCK_NAME

ROOT = pathlib.Path(__file__).resolve().parents[1]

PROGRAM = textwrap.dedent("""
    import json, os, pathlib, signal, sys, time
    sys.path.insert(0, {root!r})
    from lightray.driver import guard as driver_guard
    from lightray.driver.cluster_loss import gcs_reachable

    driver_guard.SETTLE_S = driver_guard.PYTHON_SETTLE_S = 1.0
    mode, storage, gcs = sys.argv[1:4]
    status = driver_guard.guard()
    if status is not None:  # the guardian
        sys.exit(status)
    from lightray.config import load_config
    from lightray.driver.run_lock import RunLock

    cfg = load_config("smoke", {{"name": "g", "storage": storage}})
    run_dir = os.path.join(storage, "g")
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for step in (1, 2):
            f.write(json.dumps({{"step": step, "samples_seen": 64 * step, "elapsed_s": step, "loss": 2.0}}) + "\\n")
    RunLock(run_dir, pid=driver_guard.driver_pid(), heartbeat_s=0.2 if mode == "lock_taken" else 10).acquire()
    if mode.startswith("tune"):  # a search's driver: what app/tune/search.py tells
        driver_guard.tell(run={{"kind": "tune", "name": "g", "storage": storage, "gcs_address": gcs,
                                "raylet_address": None, "own_cluster": False}})
    else:
        driver_guard.tell(run={{"name": "g", "storage": storage, "run_dir": run_dir, "local_run_dir": run_dir,
                                "t0": time.time(), "config": cfg.to_dict(), "gcs_address": gcs,
                                "raylet_address": None, "own_cluster": False, "epochs_planned": 3}})
    pathlib.Path(storage, "driver.pid").write_text(str(os.getpid()))
    if mode.endswith("ray_ends_it"):  # Ray's core worker: exit status 1 from C++ once the cluster is gone
        while gcs_reachable(gcs, timeout_s=0.5):
            time.sleep(0.1)
        os._exit(1)
    if mode == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "python_error":
        raise RuntimeError("a bug in the driver")
    if mode == "usage_error":  # what cli.main returns after its one-line ConfigError / DataError
        while gcs_reachable(gcs, timeout_s=0.5):
            time.sleep(0.1)
        print("lightray: error: data: bad value", file=sys.stderr)
        sys.exit(2)
    time.sleep(600)  # "runs": signals come from the test
""")


@pytest.fixture
def gcs():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    yield server
    server.close()


def start(tmp_path: pathlib.Path, mode: str, server: socket.socket) -> subprocess.Popen:
    program = tmp_path / "driver.py"
    program.write_text(PROGRAM.format(root=str(ROOT)))
    address = f"127.0.0.1:{server.getsockname()[1]}"
    return subprocess.Popen([sys.executable, str(program), mode, str(tmp_path / "runs"), address],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True)


def driver_pid(tmp_path: pathlib.Path, proc: subprocess.Popen) -> int:
    path = tmp_path / "runs" / "driver.pid"
    deadline = time.time() + 60
    while not path.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0] if proc.poll() else "timeout"
        time.sleep(0.05)
    return int(path.read_text())


def summary(tmp_path: pathlib.Path) -> dict:
    return json.loads((tmp_path / "runs" / "g" / "summary.json").read_text())


def test_driver_ended_by_ray_after_the_cluster_went_away_gets_summary_line_and_exit_3(tmp_path, gcs):
    proc = start(tmp_path, "ray_ends_it", gcs)
    child = driver_pid(tmp_path, proc)
    assert child != proc.pid
    # The run lock names the command the user started, not the forked driver (tests/test_run_lock.py: the
    # same through app/run.py).
    assert json.loads((tmp_path / "runs" / "g" / LOCK_NAME).read_text())["pid"] == proc.pid
    gcs.close()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_CLUSTER_LOST, out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("lightray: error:")]
    assert "was lost" in line and "its GCS does not answer" in line and "exit status 1" in line, line
    (resume,) = [ln for ln in out.splitlines() if "continue it from its last checkpoint with:" in ln]
    assert resume.endswith(f"--name g --storage {tmp_path / 'runs'} --resume"), resume
    s = summary(tmp_path)
    assert s["status"] == "failed" and s["error"].startswith("ClusterLostError:") and "was lost" in s["error"]
    assert s["samples_seen"] == 128 and s["epochs_planned"] == 3 and s["run_name"] == "g"
    assert not (tmp_path / "runs" / "g" / LOCK_NAME).exists()  # the resume command finds the run free


def test_a_driver_whose_run_another_driver_took_over_stops_at_its_next_heartbeat_and_writes_nothing(tmp_path, gcs):
    """The run lock is a fence: the lock taken over (as a driver that judged this one gone would), the driver
    ends within a heartbeat with one line naming the new holder, and neither it nor its guardian writes a
    summary or touches the new owner's lock."""
    proc = start(tmp_path, "lock_taken", gcs)
    driver_pid(tmp_path, proc)
    lock = tmp_path / "runs" / "g" / LOCK_NAME
    now = time.time()
    theirs = {"host": "another-node", "pid": 7, "start_time": now, "heartbeat": now, "token": "theirs", "beats": 0}
    tmp = lock.with_name("lock.tmp")
    tmp.write_text(json.dumps(theirs))
    os.replace(tmp, lock)
    out, _ = proc.communicate(timeout=60)  # the old code trained on: it slept out its 600 s
    assert proc.returncode == EXIT_LOCK_LOST, out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("lightray: error:")]
    assert "another driver took the run over (host another-node, pid 7," in line, line
    assert "stopped without writing more" in line, line
    assert json.loads(lock.read_text())["token"] == "theirs"
    assert not (tmp_path / "runs" / "g" / "summary.json").exists()


def test_search_driver_ended_by_ray_says_the_search_stopped_and_how_to_resume_it(tmp_path, gcs):
    proc = start(tmp_path, "tune_ray_ends_it", gcs)
    driver_pid(tmp_path, proc)
    gcs.close()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_CLUSTER_LOST, out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("lightray: error:")]
    assert "was lost" in line and "the search stopped" in line and "summary.json" not in line, line
    (resume,) = [ln for ln in out.splitlines() if "continue it from where it stopped with:" in ln]
    assert "--tune" in resume and resume.endswith(f"--name g --storage {tmp_path / 'runs'} --resume"), resume
    assert not (tmp_path / "runs" / "g" / "summary.json").exists()  # Tune's experiment folder is the state


def test_driver_killed_by_a_signal_while_the_cluster_answers_is_reported_with_its_own_status(tmp_path, gcs):
    proc = start(tmp_path, "killed", gcs)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL, out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("lightray: error:")]
    assert "killed by SIGKILL" in line and "still answers" in line, line
    s = summary(tmp_path)
    assert s["error"].startswith("DriverDiedError:") and s["samples_seen"] == 128


def test_python_error_in_the_driver_passes_through_without_a_second_report(tmp_path, gcs):
    proc = start(tmp_path, "python_error", gcs)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    assert "RuntimeError: a bug in the driver" in out
    assert not any(ln.startswith("lightray: error:") for ln in out.splitlines()), out
    assert not (tmp_path / "runs" / "g" / "summary.json").exists()


def test_usage_error_the_cli_reported_passes_through_even_with_the_cluster_gone(tmp_path, gcs):
    proc = start(tmp_path, "usage_error", gcs)
    driver_pid(tmp_path, proc)
    gcs.close()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    assert [ln for ln in out.splitlines() if ln.startswith("lightray: error:")] == [
        "lightray: error: data: bad value"], out
    assert not (tmp_path / "runs" / "g" / "summary.json").exists()


def test_sigterm_to_the_command_reaches_the_driver_and_ends_both(tmp_path, gcs):
    proc = start(tmp_path, "runs", gcs)
    child = driver_pid(tmp_path, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, out
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert not (tmp_path / "runs" / "g" / "summary.json").exists(), "a stop the user asked for is not a failure"


def test_killing_the_command_kills_the_driver_with_it(tmp_path, gcs):
    proc = start(tmp_path, "runs", gcs)
    child = driver_pid(tmp_path, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.time() + 30
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.time() < deadline, "the driver outlived the command that started it"
        time.sleep(0.05)
