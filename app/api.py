"""The Python API beside the command line: ``lightray.train(config, **overrides) -> Result`` runs what
``lightray train`` runs, in this process as its driver; ``lightray.load_model(run)`` is in ``lightray.inference``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightray.config import Config


@dataclass(frozen=True)
class Result:
    """A finished run: its ``summary.json`` as a dict, with the figures most callers want as attributes."""

    summary: dict[str, Any]

    @property
    def run_dir(self) -> str:
        return self.summary["run_dir"]

    @property
    def status(self) -> str:
        return self.summary["status"]

    @property
    def top1(self) -> float | None:
        """The final validation top-1 accuracy (a fraction), None when the run never validated."""
        return self.summary.get("final_top1")

    @property
    def top5(self) -> float | None:
        return self.summary.get("final_top5")


# Short names of config keys, as the command line's flags (--data, --workers, ...) and the API's keywords take them.
SHORTHANDS = {"data": "data.source", "workers": "scaling.workers", "gpu": "scaling.use_gpu",
              "mlflow": "report.mlflow"}


def overrides_from_kwargs(overrides: dict[str, Any]) -> dict[str, Any]:
    """Keyword overrides -> the config's dotted keys: ``schedule__epochs=3`` and ``**{"schedule.epochs": 3}`` are
    both ``schedule.epochs``; a shorthand (``data``, ``workers``, ...) is the key its command-line flag sets."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        dotted = key.replace("__", ".")
        out[SHORTHANDS.get(dotted, dotted)] = value
    return out


def resolve(cfg: Config, resume: bool) -> None:
    """Before anything starts: the run's storage and name filled in (the newest run with ``resume``), and a
    ``model.pretrained`` that names nothing refused as a usage error rather than a crash in every worker."""
    from lightray.driver.runner import resolve_run

    resolve_run(cfg, resume)
    if cfg.model.pretrained:
        from lightray.train.finetune import resolve_pretrained

        resolve_pretrained(cfg.model.pretrained)


def train(config: str = "demo", *, resume: bool = False, verbose: bool = False, **overrides: Any) -> Result:
    """Train (or with ``resume``, continue) one run of the recipe ``config`` (a name from the recipes or a YAML
    path) with ``overrides`` applied; returns when the run ends. Bad input raises ``ConfigError`` or
    ``DataError`` before anything starts; a run that fails after starting has ``status`` "failed"."""
    from lightray.config import load_config
    from lightray.driver.runner import run_training

    cfg = load_config(config, overrides_from_kwargs(overrides))
    resolve(cfg, resume)
    return Result(run_training(cfg, resume=resume, progress=False, verbose=verbose))
