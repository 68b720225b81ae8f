"""What a trial reports to Tune: the validation metric, or the time to a target accuracy.

The Train controller calls ``TrialReportCallback.after_report`` with every ``ray.train.report`` of the
run. Only reports that carry validation metrics go on to Tune: the trainer also reports at interval
checkpoints (no validation there), and ASHA and Optuna must compare trials on the same quantity.
"""

from __future__ import annotations

from typing import Any

from ray.tune.integration.ray_train import TuneReportCallback

from lightray.tune.space import TIME_METRIC

REACHED = "reached_target"


class Objective:
    """``max_metric``: pass ``metric`` through. ``time_to_target``: add ``time_to_target_s`` (min).

    Time to target is the run's training seconds (``elapsed_s``, kept across restarts) at the first
    validation with top-1 >= target. Before that it is a projection, elapsed_s * target / best top-1 so
    far, so that ASHA can rank trials that have not got there yet; a trial that never gets there keeps
    its projection, which is always above the seconds it actually ran.
    """

    def __init__(self, kind: str, metric: str, target: float) -> None:
        self.kind = kind
        self.metric = metric
        self.target = target
        self.best_top1 = 0.0
        self.reached_s: float | None = None

    def wants(self, metrics: dict[str, Any]) -> bool:
        return self.metric in metrics and "epoch" in metrics

    def for_tune(self, metrics: dict[str, Any]) -> dict[str, Any] | None:
        """What Tune gets for one of the run's reports: None for an unvalidated one, else ``augment``'s."""
        return self.augment(metrics) if self.wants(metrics) else None

    def augment(self, metrics: dict[str, Any]) -> dict[str, Any]:
        out = dict(metrics)
        if self.kind != "time_to_target":
            return out
        top1 = float(metrics.get("val_top1", 0.0))
        elapsed = float(metrics.get("elapsed_s", 0.0))
        self.best_top1 = max(self.best_top1, top1)
        if self.reached_s is None and top1 >= self.target:
            self.reached_s = elapsed
        if self.reached_s is not None:
            out[TIME_METRIC], out[REACHED] = self.reached_s, 1
        else:
            out[TIME_METRIC] = elapsed * self.target / max(self.best_top1, 1e-3)
            out[REACHED] = 0
        return out


class TrialReportCallback(TuneReportCallback):
    """``TuneReportCallback`` that forwards only validated reports, with the objective's fields added."""

    def __init__(self, objective: Objective) -> None:
        super().__init__()
        self.objective = objective

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        first = self.objective.for_tune(metrics[0]) if metrics else None
        if first is not None:
            super().after_report(run_context, [first] + list(metrics[1:]), checkpoint)
