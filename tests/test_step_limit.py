"""bench/step_limit.py, the GPU suite's per-step limit: everything a step started is ended at its limit or when it
exits, also what left the step's process group and session (as Ray's driver and Ray's own processes do)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from bench.step_limit import MARKER, marked_pids

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A step that puts a child in a session of its own (setsid), writes the child's pid, then waits.
ESCAPING = "setsid sleep 300 & echo $! > {pids}; {then}"


def _limit(seconds: str, log: pathlib.Path, script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.step_limit", seconds, str(log), "--", "bash", "-c", script],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_step_past_its_limit_is_ended_with_what_left_its_session_and_exits_124(tmp_path):
    pids = tmp_path / "pids"
    out = _limit("2", tmp_path / "step.log", ESCAPING.format(pids=pids, then="echo started; sleep 300"))
    assert out.returncode == 124, out.stderr
    assert "ran past its 2 s limit" in out.stderr
    child = int(pids.read_text())
    assert not _alive(child), f"the setsid child {child} outlived its step"
    assert (tmp_path / "step.log").read_text().strip() == "started"  # the step's output, in its log


def test_a_step_that_exits_leaving_a_process_has_it_ended_and_keeps_its_exit_status(tmp_path):
    pids = tmp_path / "pids"
    out = _limit("30", tmp_path / "step.log", ESCAPING.format(pids=pids, then="exit 3"))
    assert out.returncode == 3, out.stderr
    assert "exited 3" in out.stderr and "leaving 1 process(es)" in out.stderr
    assert not _alive(int(pids.read_text()))


def test_only_the_steps_own_processes_are_ended(tmp_path):
    other = subprocess.Popen(["sleep", "300"], env={**os.environ, MARKER: "another-step"})
    try:
        out = _limit("1", tmp_path / "step.log", "sleep 300")
        assert out.returncode == 124
        assert other.poll() is None and marked_pids(MARKER, "another-step") == [other.pid]
    finally:
        other.kill()
        other.wait()


def test_a_bad_limit_is_refused_naming_the_value(tmp_path):
    out = _limit("soon", tmp_path / "step.log", "true")
    assert out.returncode == 2 and "SECONDS: bad value 'soon'; expected a positive number" in out.stderr
