"""Seeing a run: console progress, TensorBoard events, plots + markdown report, MLflow export.

Names are loaded on first use so that importing ``app.report`` for the console view does not pull
in matplotlib, torch or tensorboard.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ProgressPrinter": "app.report.progress",
    "print_summary_table": "app.report.progress",
    "quiet_ray_logging": "app.report.progress",
    "read_metrics": "app.report.progress",
    "TBLogger": "app.report.tensorboard_log",
    "read_scalars": "app.report.tensorboard_log",
    "make_report": "app.report.markdown",
    "ReportError": "app.report.plots",
    "log_run": "app.report.mlflow_log",
    "MissingExtraError": "app.report.mlflow_log",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'app.report' has no attribute {name!r}")
