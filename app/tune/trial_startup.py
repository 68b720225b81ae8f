"""Where each trial's time goes until its first training step, read back from the trial's run folder.

A trial writes ``trial_start.json`` (the moment its function began) before its run starts; the run writes
``startup.json`` (driver-side phases: data prepare, materialisation, calibration, trainer set-up) and
``metrics.jsonl`` (the worker group's ``start`` and the ``first_step`` events). ``lightray.startup.breakdown``
joins them into contiguous seconds per phase from the trial's own start, so a search can say which step a
slow trial spent its start in, and ``summarize`` gives the median of each phase over the trials.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from lightray import startup

TRIAL_START_FILE = "trial_start.json"


def trial_startup(run_dir: str) -> dict[str, Any] | None:
    """``{first_step_s, phases_s, shared}`` of one trial, or None when the run left too little to tell."""
    from lightray.storage import read_json, read_jsonl

    try:
        mark = read_json(os.path.join(run_dir, TRIAL_START_FILE))
        rec = read_json(os.path.join(run_dir, startup.FILE))
        events = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    except (OSError, ValueError):
        return None
    out = startup.breakdown(rec, events, origin=float(mark["start"]))
    if out["first_step_s"] is None:
        return None
    # The time before the run's first mark is the trial's own set-up (config, run lock), not Python imports.
    phases = dict(out["phases_s"])
    if "imports" in phases:
        phases["trial_setup"] = phases.pop("imports")
    return {"first_step_s": out["first_step_s"], "phases_s": phases, "shared": bool(mark.get("shared")),
            "runner": mark.get("runner", "train")}


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Median time to first step and median seconds per phase over the trials that reached a step."""
    rows = [r["startup"] for r in records if r.get("startup")]
    if not rows:
        return {"trials": 0, "first_step_s_median": None, "phases_s_median": {}}
    names = sorted({k for r in rows for k in r["phases_s"]})
    first = [r["first_step_s"] for r in rows]
    return {"trials": len(rows),
            "first_step_s_median": round(statistics.median(first), 2),
            "first_step_s_min_max": [round(min(first), 2), round(max(first), 2)],
            "phases_s_median": {k: round(statistics.median(r["phases_s"].get(k, 0.0) for r in rows), 2)
                                for k in names}}
