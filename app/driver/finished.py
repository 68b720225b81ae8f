"""Is there anything left for a resume to train? A run resumed after it finished (a RayJob always passes
``--resume``; a script that resumes whatever it finds) has nothing to do, and starting Ray and a worker group to
find that out costs half a minute. The stored summary is answer enough when the run trained every sample its
recipe plans and the recipe asked for now is the one it ran: what it trains (data, model, optimiser, schedule)
is compared section by section. Any doubt (a file missing or unreadable, a section changed, fewer samples than
planned) answers "not finished", and the resume goes the usual way, which sorts every such case out itself."""

from __future__ import annotations

from typing import Any

import yaml

from lightray import storage
from lightray.config import Config
from lightray.schedule import Schedule
from lightray.storage import join
from lightray.train.state import newest_meta

SECTIONS = ("data", "model", "optim", "schedule")  # what decides the samples a run plans and the model it makes
WHERE = ("cache_dir", "local_cache_dir")  # where the shards are kept: another machine resumes with its own


def already_finished(cfg: Config, run_dir: str) -> dict[str, Any] | None:
    """The run's stored summary when it finished every planned sample of the recipe ``cfg`` asks for; else
    None."""
    try:
        summary = storage.read_json(join(run_dir, "summary.json"))
        ran = yaml.safe_load(storage.read_text(join(run_dir, "config.yaml")))
        train_samples = int(storage.read_json(join(run_dir, "data.json"))["train_samples"])
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None
    if not isinstance(summary, dict) or summary.get("status") != "finished" or not isinstance(ran, dict):
        return None
    # The same YAML round trip as config.yaml's, so that tuples and lists compare alike.
    now = yaml.safe_load(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    if any(_what(now, section) != _what(ran, section) for section in SECTIONS):
        return None
    total = Schedule(cfg.schedule, cfg.optim, train_samples).total_samples
    newest = newest_meta(run_dir)
    if newest is None or int(newest[1].get("samples_seen", -1)) < total or summary.get("samples_seen") != total:
        return None
    return summary


def say_finished(summary: dict[str, Any], run_dir: str) -> str:
    """The one line a resume of a finished run prints."""
    top1 = summary.get("final_top1")
    return (f"lightray: run {run_dir} already finished all {summary['samples_seen']} planned samples "
            f"(final top-1 {'n/a' if top1 is None else f'{top1:.2%}'}); nothing to resume, Ray not started")


def _what(config: dict[str, Any], section: str) -> Any:
    """A section of a config as a dict, less the keys that only say where things are kept."""
    part = config.get(section)
    return {k: v for k, v in part.items() if k not in WHERE} if isinstance(part, dict) else part
