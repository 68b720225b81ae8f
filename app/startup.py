"""Where a run's start-up time goes: named phases on the driver, written to ``<run>/startup.json``.

The driver marks each start-up step (Ray start, data check/prepare, materialisation, calibration, trainer
set-up) with :func:`phase`; the worker group's start and the first step are events that rank 0 sends to
``metrics.jsonl`` (``start`` and ``first_step``). :func:`breakdown` joins both into seconds per phase,
from the moment the command's process started, so a slow start says which step it spent its time in.

The clock is module-level on purpose: the steps live in different modules (runner, ingest, autotune)
and each only needs ``with startup.phase("name"):``, not a handle passed through every signature.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

FILE = "startup.json"
_phases: list[dict[str, Any]] = []
# What starts the worker(s) between the driver's marks and the ``start`` event: a Ray Train worker group, or
# (``app/train/inline.py``) the run's one worker in the driver's own process.
_group = {"phase": "worker_group_start"}


def process_start_time() -> float:
    """Wall-clock time at which this process started (the command's start for ``python app/run.py``)."""
    try:
        import psutil  # comes with ray[default]

        return float(psutil.Process().create_time())
    except Exception:  # no psutil, or a platform without process times: the import of this module is close
        return _IMPORTED


_IMPORTED = time.time()


def reset() -> None:
    """Forget earlier marks (one driver process can run several trainings: benches, tune trials)."""
    _phases.clear()
    _group["phase"] = "worker_group_start"


def name_group_phase(name: str) -> None:
    """Name the phase before the worker's ``start`` event (default ``worker_group_start``)."""
    _group["phase"] = name


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the enclosed start-up step under ``name`` (nested or repeated names are kept as they come)."""
    start = time.time()
    try:
        yield
    finally:
        _phases.append({"phase": name, "start": start, "end": time.time()})


def add(name: str, start: float, end: float | None = None) -> None:
    """Record a step that began at ``start`` (``time.time()``) and ends now (or at ``end``)."""
    _phases.append({"phase": name, "start": start, "end": time.time() if end is None else end})


def record() -> dict[str, Any]:
    return {"process_start": process_start_time(), "phases": list(_phases), "pid": os.getpid(),
            "group_phase": _group["phase"]}


def write(local_run_dir: str) -> str:
    """Write the marks so far to ``<local_run_dir>/startup.json``; returns the path."""
    path = os.path.join(local_run_dir, FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record(), f, indent=1)
    os.replace(tmp, path)
    return path


def breakdown(startup: dict[str, Any], events: list[dict[str, Any]], origin: float | None = None) -> dict[str, Any]:
    """Seconds per start-up phase from ``origin`` (default: the process start) to the first training step.

    ``startup`` is a ``startup.json`` record, ``events`` the run's ``metrics.jsonl`` records. The phases
    are contiguous: ``imports`` runs from the origin to the first driver mark, ``worker_group_start`` (or the
    record's ``group_phase``: ``inline_start`` for a run of one worker in the driver) from the last driver
    mark to the worker group's ``start`` event less the worker's own set-up (Ray Train placing and starting
    the group), ``worker_setup`` the worker's set-up (model, DDP, comm hook, checkpoint read:
    the event's ``setup_s``), ``first_batch`` from there to the ``first_step`` event; time between
    driver marks lands in ``other``. Phases that did not happen are absent; ``first_step_s`` is None when the run never
    reached a step."""
    t0 = origin if origin is not None else startup["process_start"]
    marks = sorted(startup.get("phases", []), key=lambda p: p["start"])
    out: dict[str, float] = {}
    cursor = t0
    other = 0.0
    for m in marks:
        if not out and m["start"] > cursor:
            out["imports"] = m["start"] - cursor
        elif m["start"] > cursor:
            other += m["start"] - cursor
        out[m["phase"]] = out.get(m["phase"], 0.0) + (m["end"] - m["start"])
        cursor = max(cursor, m["end"])
    start_event = next((e for e in events if e.get("event") in ("start", "restart")), None)
    start = start_event["time"] if start_event is not None else None
    first = next((e["time"] for e in events if e.get("event") == "first_step"), None)
    if start is not None:
        setup = min(float(start_event.get("setup_s", 0.0)), max(0.0, start - cursor))
        out[startup.get("group_phase", "worker_group_start")] = max(0.0, start - cursor) - setup
        if "setup_s" in start_event:
            out["worker_setup"] = setup
        cursor = max(cursor, start)
    if first is not None:
        out["first_batch"] = max(0.0, first - cursor)
    if other > 0.05:
        out["other"] = other
    return {"first_step_s": round(first - t0, 2) if first is not None else None,
            "phases_s": {k: round(v, 2) for k, v in out.items()}}
