"""In CI the heavy slow tests and the short ``shares_cpu`` tests run in two pytest processes at once (.ci/run). A
test marked ``timing_bound`` assumes the machine to itself, so it waits for the ``shares_cpu`` test in flight to
end, and no ``shares_cpu`` test starts until the run of ``timing_bound`` tests is over.

Sorting alone did not give that. The CI run of stop 55 (2026-12-06) ran the soak beside the ``shares_cpu``
process. The soak's first step came after 307 s, against 47 s alone, so its test failed, and three smoke runs
beside it passed their 280 s limit.

The gate is two ``flock`` locks in the folder both processes share (``LIGHTRAY_TEST_SHARED``). The heavy side
takes *intent* exclusively, then *gate* exclusively, and holds both until the next test is not timing_bound.
A ``shares_cpu`` test takes *intent* shared for a moment (it blocks while the heavy side wants the machine),
then holds *gate* shared for the length of the test. So the heavy side cannot starve behind a chain of short
tests, and each side waits on the kernel, not on a sleep."""

from __future__ import annotations

import fcntl
import os
import pathlib
import time

import pytest

INTENT = "machine_gate.intent"
GATE = "machine_gate.lock"


class MachineGate:
    """The two locks, held from one process. ``blocking=False`` raises BlockingIOError instead of waiting."""

    def __init__(self, folder: pathlib.Path):
        folder.mkdir(parents=True, exist_ok=True)
        self._intent = open(folder / INTENT, "a+")  # held for the process's life
        self._gate = open(folder / GATE, "a+")
        self.waited_s = 0.0  # in total, this process, for the other side

    def _lock(self, f, how: int, blocking: bool) -> None:
        fcntl.flock(f, how if blocking else how | fcntl.LOCK_NB)

    def take_machine(self, blocking: bool = True) -> None:
        """For a run of timing_bound tests: wait out the shares_cpu test in flight, hold off the next."""
        t0 = time.monotonic()
        self._lock(self._intent, fcntl.LOCK_EX, blocking)
        try:
            self._lock(self._gate, fcntl.LOCK_EX, blocking)
        except BlockingIOError:
            fcntl.flock(self._intent, fcntl.LOCK_UN)
            raise
        self.waited_s += time.monotonic() - t0

    def give_machine(self) -> None:
        fcntl.flock(self._gate, fcntl.LOCK_UN)
        fcntl.flock(self._intent, fcntl.LOCK_UN)

    def enter_beside(self, blocking: bool = True) -> None:
        """For one shares_cpu test: wait while a timing_bound run holds or wants the machine."""
        t0 = time.monotonic()
        self._lock(self._intent, fcntl.LOCK_SH, blocking)
        try:
            self._lock(self._gate, fcntl.LOCK_SH, blocking)
        finally:
            fcntl.flock(self._intent, fcntl.LOCK_UN)
        self.waited_s += time.monotonic() - t0

    def leave_beside(self) -> None:
        fcntl.flock(self._gate, fcntl.LOCK_UN)


def _marked(item, name: str) -> bool:
    return item is not None and item.get_closest_marker(name) is not None


class MachineGatePlugin:
    """Wraps each test's whole protocol (setup, call, teardown), outside its timeout and its CPU count."""

    def __init__(self, gate: MachineGate):
        self.gate = gate
        self.holding = False
        self.gated = 0  # tests this process ran through the gate

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if _marked(item, "timing_bound") or _marked(item, "shares_cpu"):
            self.gated += 1
        if _marked(item, "timing_bound"):
            if not self.holding:
                self.gate.take_machine()
                self.holding = True
            try:
                yield
            finally:
                # A run of timing_bound tests (the soak's three share one background soak) keeps the machine.
                if not _marked(nextitem, "timing_bound"):
                    self.gate.give_machine()
                    self.holding = False
        elif _marked(item, "shares_cpu"):
            self.gate.enter_beside()
            try:
                yield
            finally:
                self.gate.leave_beside()
        else:
            yield

    def pytest_terminal_summary(self, terminalreporter):
        if not self.gated:  # the default suite: nothing here is gated
            return
        terminalreporter.write_line(f"machine gate: this process waited {self.gate.waited_s:.0f} s for the other "
                                    "(timing_bound tests have the machine to themselves; tests/machine_gate.py)")


def register(config) -> None:
    """Only where a folder is shared between pytest processes (CI's LIGHTRAY_TEST_SHARED): alone, there is
    nothing to wait for."""
    shared = os.environ.get("LIGHTRAY_TEST_SHARED")
    if shared:
        config.pluginmanager.register(MachineGatePlugin(MachineGate(pathlib.Path(shared))), "lightray-machine-gate")
