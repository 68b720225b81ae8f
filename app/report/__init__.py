"""Seeing a run: console progress, TensorBoard events, plots + markdown report, MLflow export.

Names are loaded on first use so that importing ``lightray.report`` for the console view does not pull
in matplotlib, torch or tensorboard.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ProgressPrinter": "lightray.report.progress",
    "print_summary_table": "lightray.report.progress",
    "quiet_ray_logging": "lightray.report.progress",
    "read_metrics": "lightray.report.progress",
    "TBLogger": "lightray.report.tensorboard_log",
    "read_scalars": "lightray.report.tensorboard_log",
    "make_report": "lightray.report.markdown",
    "ReportError": "lightray.report.plots",
    "log_run": "lightray.report.mlflow_log",
    "MissingExtraError": "lightray.report.mlflow_log",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lightray.report' has no attribute {name!r}")
