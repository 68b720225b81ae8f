"""TensorBoard events for a run, written by rank 0 into ``<run_dir>/tensorboard/``.

Metric keys (docs/INTERFACES.md) map to grouped tags so TensorBoard shows one panel per concern:
``train/`` what the optimizer sees, ``val/`` held-out accuracy, ``schedule/`` what the schedule chose
(LR, resolution, batch size), ``system/`` speed, communication and elasticity. Keys not listed are
left out on purpose (``step``, ``time``, ... are axes, not curves).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

TAGS: dict[str, str] = {
    "loss": "train/loss",
    "epoch_progress": "train/epoch",
    "val_top1": "val/top1",
    "val_top5": "val/top5",
    "val_loss": "val/loss",
    "lr": "schedule/lr",
    "momentum": "schedule/momentum",
    "resolution": "schedule/resolution",
    "batch_size": "schedule/batch_size",
    "phase": "schedule/phase",
    "images_per_s": "system/images_per_s",
    "data_wait_frac": "system/data_wait_frac",
    "comm_bytes": "system/comm_bytes",
    "restarts": "system/restarts",
    "resizes": "system/resizes",
    "world_size": "system/world_size",
    "device_seconds": "system/device_seconds",
}


def tag_for(key: str) -> str | None:
    """The TensorBoard tag of a metric key, or None for keys that are not logged."""
    return TAGS.get(key)


class TBLogger:
    """Scalar writer for rank 0 (one per run folder; each Tune trial has its own run folder).

    ``purge_step``: on a restart from a checkpoint at step N, pass N so TensorBoard drops the
    events the lost attempt wrote at steps >= N instead of drawing the curve twice.
    """

    def __init__(self, log_dir: str, purge_step: int | None = None, flush_secs: int = 30):
        # Imported here: tensorboard's protos cost a second, and only the run log needs them.
        from lightray.report.tb_events import EventWriter

        self.log_dir = str(log_dir)
        os.makedirs(self.log_dir, exist_ok=True)
        self._writer = EventWriter(self.log_dir, purge_step=purge_step, flush_secs=flush_secs)

    def scalars(self, metrics: dict[str, Any], step: int) -> list[str]:
        """Log every known numeric key of ``metrics`` at ``step``; returns the tags written."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step: bad value {step!r}; expected an int (global step)")
        wall = metrics.get("time")
        wall = float(wall) if isinstance(wall, (int, float)) and not isinstance(wall, bool) else None
        written = []
        for key, value in metrics.items():
            tag = TAGS.get(key)
            if tag is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            value = float(value)
            if math.isinf(value):  # TensorBoard draws inf as a gap anyway; keep the file tidy
                continue
            self._writer.add_scalar(tag, value, global_step=step, walltime=wall)
            written.append(tag)
        return written

    def event(self, record: dict[str, Any], step: int) -> None:
        """An event line (restart, resize, unit, ...) as text, so TensorBoard shows what happened when."""
        from lightray.report.progress import format_event

        self._writer.add_text("events", format_event(record), global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> TBLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """All scalars in the event files of ``log_dir``: tag -> [(step, value)] in step order."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    path = Path(log_dir)
    if not path.is_dir() or not any(p.name.startswith("events.out.tfevents") for p in path.iterdir()):
        raise FileNotFoundError(f"{log_dir}: no TensorBoard event files (events.out.tfevents.*) in this folder")
    acc = EventAccumulator(str(path), size_guidance={SCALARS: 0})  # 0 = keep every point
    acc.Reload()
    out: dict[str, list[tuple[int, float]]] = {}
    for tag in acc.Tags().get("scalars", []):
        out[tag] = sorted((int(e.step), float(e.value)) for e in acc.Scalars(tag))
    return out
