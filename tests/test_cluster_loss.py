"""The Ray cluster a run joined goes away mid-run: the driver says so in one line, writes summary.json
(failed, the cause), prints the command that continues the run and exits non-zero, before Ray's own
60-second limit ends the process without a word.

The cluster is a real ``ray start --head --block`` process of its own (another program's cluster, in its own
temp dir so that this machine's other Ray users are untouched); it is stopped the way ``ray stop`` stops one:
SIGTERM to each of its processes, SIGKILL to what is left after a grace period."""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import shutil
import socket
import subprocess
import threading
import time

import psutil
import pytest

from bench.common import stop_processes
from lightray.driver.cluster_loss import EXIT_CLUSTER_LOST, ClusterWatch, gcs_reachable, resume_command
from tests.faults import checkpoints, driver, kill_group, last_samples, long_run, wait_for
from tests.ports import free_port


def _named(proc: psutil.Process, name: str) -> bool:
    """Whether ``proc`` is called ``name``; a process that ended since it was listed (a Ray worker leaving) is not."""
    try:
        return proc.name() == name
    except psutil.NoSuchProcess:
        return False


class HeadCluster:
    """``ray start --head --block`` in its own session and temp dir; ``stop()`` ends all its processes."""

    def __init__(self, tmp: pathlib.Path):
        self.port = free_port()
        self.temp_dir = pathlib.Path(f"/tmp/lr-head-{self.port}")  # short: Ray's socket paths have a length cap
        self.log = open(tmp / "head.log", "w")
        self.proc = subprocess.Popen(
            ["ray", "start", "--head", f"--port={self.port}", "--num-cpus=4", '--resources={"trainer": 2}',
             f"--temp-dir={self.temp_dir}", "--include-dashboard=false", "--disable-usage-stats", "--block"],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "RAY_AUTH_MODE": "disabled"},
            start_new_session=True)
        self.address = f"127.0.0.1:{self.port}"
        wait_for(lambda: gcs_reachable(self.address), 120, "the head's GCS port")

    def stop(self, only: str | None = None) -> None:
        """Stop every process of the cluster, or with ``only`` those whose name is ``only`` (e.g. the raylet)."""
        try:
            root = psutil.Process(self.proc.pid)
            procs = root.children(recursive=True) + [root]
        except psutil.NoSuchProcess:
            procs = []
        if only is not None:
            stop_processes([p for p in procs if _named(p, only)])
            return
        stop_processes(procs)
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def test_resume_command_keeps_the_flags_and_pins_name_storage_and_resume():
    argv = ["app/run.py", "--smoke-test", "--storage", "/old", "--name=x", "--resume", "--schedule.epochs=3"]
    cmd = resume_command("run-1", "/runs", argv)
    assert shlex.split(cmd) == ["python", "app/run.py", "--smoke-test", "--schedule.epochs=3",
                                "--name", "run-1", "--storage", "/runs", "--resume"]
    # A run started from elsewhere (a bench, a notebook) gets the plain command.
    assert shlex.split(resume_command("r", "s3://b/runs", ["-m", "bench.chaos"])) == \
        ["python", "app/run.py", "--name", "r", "--storage", "s3://b/runs", "--resume"]


def test_watch_calls_the_loss_handler_once_the_port_stays_closed_past_the_grace():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    fired: list[tuple[float, str]] = []
    done = threading.Event()
    watch = ClusterWatch(address, lambda cause: (fired.append((time.time(), cause)), done.set()),
                         every_s=0.1, grace_s=1.0).start()
    try:
        time.sleep(0.5)
        assert not fired  # reachable: nothing happens
        closed_at = time.time()
        server.close()
        assert done.wait(10)
        (when, cause), = fired
        # The grace counts from the last probe that answered (at most one probe interval before the close).
        assert when - closed_at >= 1.0 - 0.1 - 0.05 and address in cause and "lost" in cause
    finally:
        watch.stop()
        server.close()


def test_watch_stopped_before_the_loss_never_fires():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens here
    fired = []
    watch = ClusterWatch(address, fired.append, every_s=0.1, grace_s=0.5).start()
    watch.stop()
    time.sleep(1.0)
    assert fired == []


def train_then_stop(tmp_path: pathlib.Path, shared_cache: pathlib.Path, name: str, only: str | None = None):
    """A driver on its own head cluster, trained to a checkpoint, then the cluster stopped (or only the processes
    named ``only``); returns (head, the finished driver, its output, seconds from the stop to its exit)."""
    head = HeadCluster(tmp_path)
    proc = None
    try:
        proc = driver(tmp_path / "runs", name, *long_run(8), cache=shared_cache, address=head.address,
                      env={"RAY_AUTH_MODE": "disabled"})
        run = tmp_path / "runs" / name
        wait_for(lambda: checkpoints(run) and last_samples(run) > 0, 600, "a checkpoint and training steps", proc)
        stopped_at = time.time()
        head.stop(only=only)
        out, _ = proc.communicate(timeout=120)
        return head, proc, out, time.time() - stopped_at
    finally:
        if proc is not None and proc.poll() is None:
            kill_group(proc)
        head.stop()


@pytest.mark.timing_bound
@pytest.mark.slow
def test_run_on_a_cluster_that_is_stopped_mid_run_fails_in_one_line_with_summary_and_resume_command(
        tmp_path, shared_cache):
    name = "lost-cluster"
    head, proc, out, exited_after = train_then_stop(tmp_path, shared_cache, name)
    run = tmp_path / "runs" / name
    assert proc.returncode == EXIT_CLUSTER_LOST, out[-4000:]
    # Before Ray's own 60 s limit on a lost GCS would have ended the driver silently.
    assert exited_after < 60, exited_after
    lines = out.splitlines()
    lost = [ln for ln in lines if ln.startswith("lightray: error:") and "was lost" in ln]
    assert len(lost) == 1 and head.address.split(":")[1] in lost[0], out[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["error"].startswith("ClusterLostError:") and "was lost" in summary["error"]
    assert summary["samples_seen"] > 0 and summary["run_name"] == name
    # The printed command continues this run: same storage and name, --resume, the run's own flags.
    (resume_line,) = [ln for ln in lines if "continue it from its last checkpoint with:" in ln]
    cmd = shlex.split(resume_line.split("with: ", 1)[1])
    from lightray.cli import build_parser, config_from_args

    args, rest = build_parser().parse_known_args(cmd[2:])
    cfg = config_from_args(args, rest)
    assert args.resume and args.smoke_test
    assert (cfg.name, pathlib.Path(cfg.storage)) == (name, tmp_path / "runs")
    assert cfg.schedule.epochs == 8 and cfg.checkpoint.every_steps == 4
    # The lock was released, and the checkpoints a resume needs are there.
    assert not (run / "driver.lock").exists()
    assert checkpoints(run)


@pytest.mark.timing_bound
@pytest.mark.slow
def test_driver_that_ray_ends_when_its_raylet_stops_is_still_reported_in_one_line_with_exit_3(
        tmp_path, shared_cache):
    """The order of a ``ray stop`` in which the driver's own raylet goes first: Ray's core worker ends the driver
    from C++ at once (exit status 1, not a word), and the guardian process (app/driver/guard.py) speaks."""
    name = "lost-raylet"
    # Only the raylet: the GCS still answers, so the driver's ClusterWatch alone would never fire.
    head, proc, out, _ = train_then_stop(tmp_path, shared_cache, name, only="raylet")
    run = tmp_path / "runs" / name
    assert proc.returncode == EXIT_CLUSTER_LOST, out[-4000:]
    (lost,) = [ln for ln in out.splitlines() if ln.startswith("lightray: error:")]
    assert "was lost" in lost and "raylet" in lost and head.address.split(":")[1] in lost, lost
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("ClusterLostError:")
    assert summary["samples_seen"] > 0 and summary["epochs_planned"] == 8
    assert any("continue it from its last checkpoint with:" in ln and "--resume" in ln for ln in out.splitlines())
    assert not (run / "driver.lock").exists() and checkpoints(run)
