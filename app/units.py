"""The log of the speed-up units: every switchable unit says in one line what it did (also when it was off or did
not apply), so that a run's log shows which speed-ups were really active. The worker loop drains the lines with
:func:`pop_unit_events` and writes them to ``metrics.jsonl`` as ``{"event": "unit", ...}``. A leaf: any room
(training, communication, data) logs through it."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("lightray.unit")

# Lines said by the units since the last pop; kept in-process so the worker loop can forward them to
# metrics.jsonl without every unit needing a handle on the run's writer.
_UNIT_EVENTS: list[dict[str, Any]] = []



def unit_log(unit: str, message: str, **fields: Any) -> None:
    """Record what a speed-up unit did: one log line plus an event for ``metrics.jsonl``."""
    log.info("[%s] %s", unit, message)
    if len(_UNIT_EVENTS) < 1000:  # units speak at setup; the cap only guards a process nobody drains
        _UNIT_EVENTS.append({"unit": unit, "message": message, **fields})


def pop_unit_events() -> list[dict[str, Any]]:
    """The unit events said since the last call (oldest first), clearing the list."""
    events = list(_UNIT_EVENTS)
    _UNIT_EVENTS.clear()
    return events
