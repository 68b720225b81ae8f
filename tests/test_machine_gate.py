"""tests/machine_gate.py: in CI a timing_bound test has the machine to itself, and the shares_cpu tests run
beside the other slow tests only. Each gate below opens the lock files anew, as a second pytest process would:
flock's locks belong to an open file, so two gates in one process contend as two processes do."""

from __future__ import annotations

import fcntl
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from tests.machine_gate import MachineGate

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_no_shares_cpu_test_starts_while_timing_bound_tests_hold_the_machine(tmp_path):
    heavy, beside = MachineGate(tmp_path), MachineGate(tmp_path)
    heavy.take_machine()
    with pytest.raises(BlockingIOError):
        beside.enter_beside(blocking=False)
    heavy.give_machine()
    beside.enter_beside(blocking=False)


def test_a_timing_bound_test_waits_for_the_shares_cpu_test_in_flight(tmp_path):
    heavy, beside = MachineGate(tmp_path), MachineGate(tmp_path)
    beside.enter_beside()
    with pytest.raises(BlockingIOError):
        heavy.take_machine(blocking=False)
    beside.leave_beside()
    heavy.take_machine(blocking=False)


def test_a_waiting_timing_bound_run_holds_off_the_next_shares_cpu_test(tmp_path):
    # Without the intent lock a chain of short shares_cpu tests, each taking the gate shared as the last let go,
    # could keep the heavy side waiting for the rest of the run.
    heavy, first, second = MachineGate(tmp_path), MachineGate(tmp_path), MachineGate(tmp_path)
    first.enter_beside()
    fcntl.flock(heavy._intent, fcntl.LOCK_EX)  # take_machine's first step; its second waits for `first`
    with pytest.raises(BlockingIOError):
        second.enter_beside(blocking=False)
    first.leave_beside()
    fcntl.flock(heavy._gate, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_the_plugin_holds_the_machine_over_a_run_of_timing_bound_tests_and_gives_it_back(tmp_path):
    """A real pytest process with the plugin: each test probes the gate from a gate of its own."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        from tests import machine_gate

        def pytest_configure(config):
            config.addinivalue_line("markers", "timing_bound: x")
            config.addinivalue_line("markers", "shares_cpu: x")
            machine_gate.register(config)
    """))
    (tmp_path / "test_probe.py").write_text(textwrap.dedent("""
        import os, pathlib
        import pytest
        from tests.machine_gate import MachineGate

        def probe_gate():
            return MachineGate(pathlib.Path(os.environ["LIGHTRAY_TEST_SHARED"]))

        def beside_could_start():
            try:
                probe_gate().enter_beside(blocking=False)
            except BlockingIOError:
                return False
            return True

        def heavy_could_start():
            try:
                probe_gate().take_machine(blocking=False)
            except BlockingIOError:
                return False
            return True

        @pytest.mark.shares_cpu
        def test_beside():
            assert not heavy_could_start()

        @pytest.mark.timing_bound
        def test_first_timing_bound():
            assert not beside_could_start()

        @pytest.mark.timing_bound
        def test_second_timing_bound():
            assert not beside_could_start()

        def test_after_the_run():
            assert beside_could_start() and heavy_could_start()
    """))
    shared = tmp_path / "shared"
    env = {**os.environ, "LIGHTRAY_TEST_SHARED": str(shared), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           str(tmp_path / "test_probe.py")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "4 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "machine gate: this process waited" in proc.stdout
