"""Where the suite's CPU goes: the whole machine's busy CPU-seconds during each test (setup, call and teardown),
read from /proc/stat before and after it, and a table of the heaviest at the end of the run.

A test here is mostly other processes (Ray's, the drivers it starts, their Train workers), which a per-process
clock would miss; the machine's counters see them all. On a machine running nothing else and one test at a time
(the slow suite) the figure is that test's; in two pytest-xdist processes the tests beside it are counted too, so
the table says so. Where /proc/stat is missing (not Linux) nothing is recorded."""

from __future__ import annotations

import os

import pytest

KEY = "busy_cpu_s"
SHOWN = 15


def busy_cpu_seconds() -> float | None:
    """CPU-seconds every core has spent busy since boot (user, nice, system, irq, softirq, steal), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


_starts: dict[str, float | None] = {}  # nodeid -> the machine's busy CPU-s as the test began (this process)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _starts[item.nodeid] = busy_cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "teardown":
        return
    start = _starts.pop(item.nodeid, None)
    now = busy_cpu_seconds()
    if start is not None and now is not None:
        report.user_properties.append((KEY, round(now - start, 1)))


_seen: dict[str, tuple[float, float]] = {}  # nodeid -> (busy CPU-s, wall s), on the process that reports
_wall: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _wall[report.nodeid] = _wall.get(report.nodeid, 0.0) + report.duration
    if report.when == "teardown":
        busy = dict(report.user_properties).get(KEY)
        if busy is not None:
            _seen[report.nodeid] = (busy, _wall[report.nodeid])


def pytest_terminal_summary(terminalreporter, config):
    if not _seen or hasattr(config, "workerinput"):  # a pytest-xdist worker: its controller prints the table
        return
    shared = bool(getattr(config.option, "numprocesses", None))
    terminalreporter.section(f"busiest tests: the machine's busy CPU-seconds during each (top {SHOWN})")
    if shared:
        terminalreporter.write_line("in several test processes: the tests running beside each are counted too")
    total = sum(b for b, _ in _seen.values())
    for nodeid, (busy, wall) in sorted(_seen.items(), key=lambda kv: -kv[1][0])[:SHOWN]:
        terminalreporter.write_line(f"{busy:8.1f} CPU-s {wall:7.1f} s wall  {nodeid}")
    terminalreporter.write_line(f"{total:8.1f} CPU-s over {len(_seen)} tests")
