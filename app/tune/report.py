"""Reading a finished (or stopped) search: ``python app/run.py --report EXPERIMENT`` on a tune experiment.

Writes into ``<experiment>/report/``:
- ``importances.json``: Optuna's parameter importances for the study (fANOVA; ``{}`` when the study has too
  few finished trials or no variation to explain);
- ``parallel_coordinates.png``: one line per trial across one axis per parameter and a last axis for the
  metric, drawn with matplotlib; log-scaled parameters on log axes, choices at evenly spaced ticks, lines
  coloured by the metric, trials ASHA stopped dashed;
- ``search.md``: the importances and the table of trials with the rung each stopped at and its start-up
  seconds to the first step.
Everything comes from the experiment folder (``tune_space.yaml``, ``base_config.yaml``, ``trials.json``,
the Optuna study), so a report can be redrawn at any time without Ray.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
import warnings
from typing import Any

import yaml

from lightray.config import config_from_dict
from lightray.tune.space import SearchSpace, parse_space

log = logging.getLogger("lightray.tune")

SPACE_FILE = "tune_space.yaml"
BASE_FILE = "base_config.yaml"
TRIALS_FILE = "trials.json"
STUDY_FILE = "optuna.db"
IMPORTANCES_FILE = "importances.json"
PARALLEL_FILE = "parallel_coordinates.png"
MARKDOWN_FILE = "search.md"


def is_experiment(path: str | pathlib.Path) -> bool:
    return (pathlib.Path(path) / SPACE_FILE).is_file()


def load_experiment(exp_dir: pathlib.Path) -> tuple[SearchSpace, list[dict[str, Any]]]:
    base = config_from_dict(yaml.safe_load((exp_dir / BASE_FILE).read_text()))
    sp = parse_space(yaml.safe_load((exp_dir / SPACE_FILE).read_text()), base, str(exp_dir / SPACE_FILE))
    trials_path = exp_dir / TRIALS_FILE
    records = json.loads(trials_path.read_text()) if trials_path.is_file() else []
    return sp, records


def study_storage_url(sp: SearchSpace, exp_dir: pathlib.Path) -> str:
    return sp.study_storage or f"sqlite:///{exp_dir / STUDY_FILE}"


def importances(exp_dir: pathlib.Path, sp: SearchSpace) -> dict[str, float]:
    """Optuna's parameter importances for the study, or {} when it cannot give them (too few trials)."""
    import optuna

    try:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.load_study(study_name=exp_dir.name, storage=study_storage_url(sp, exp_dir))
        done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        if len(done) < 2 or len(sp.params) < 1:
            return {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return {k: round(float(v), 4) for k, v in optuna.importance.get_param_importances(study).items()}
    except Exception as exc:  # importance needs variation in the finished trials; the report does without it
        log.info("parameter importance not available: %s", exc)
        return {}


def _axis_values(sp: SearchSpace, key: str, values: list[Any]) -> tuple[list[float | None], list, list[str]]:
    """Trial values on a [0, 1] axis, with tick positions and labels for the axis."""
    prm = next(p for p in sp.params if p.key == key)
    if prm.dist == "choice":
        n = max(1, len(prm.values) - 1)
        pos = {str(v): i / n for i, v in enumerate(prm.values)}
        return [pos.get(str(v)) for v in values], list(pos.values()), list(pos)
    log_scale = prm.dist == "loguniform" or prm.log
    lo, hi = float(prm.low), float(prm.high)
    f = (lambda x: math.log(x)) if log_scale else (lambda x: x)  # noqa: E731

    def norm(v: Any) -> float | None:
        if not isinstance(v, (int, float)) or (log_scale and v <= 0):
            return None
        return (f(float(v)) - f(lo)) / ((f(hi) - f(lo)) or 1.0)

    return [norm(v) for v in values], [0.0, 1.0], [f"{lo:.3g}", f"{hi:.3g}"]


def plot_parallel(path: pathlib.Path, sp: SearchSpace, records: list[dict[str, Any]], metric: str) -> pathlib.Path:
    """The parallel-coordinates plot (see the module doc)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [p.key for p in sp.params]
    scored = [r for r in records if isinstance(r.get("metric"), (int, float))]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.8 * (len(keys) + 1)), 4.8))
    cols = [_axis_values(sp, k, [r["params"].get(k) for r in scored]) for k in keys]
    vals = [float(r["metric"]) for r in scored]
    lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
    mnorm = [(v - lo) / ((hi - lo) or 1.0) for v in vals]
    cmap = plt.get_cmap("viridis" if sp.tune_mode == "max" else "viridis_r")
    for i, r in enumerate(scored):
        ys = [c[0][i] for c in cols] + [mnorm[i]]
        xs = [x for x, y in zip(range(len(ys)), ys) if y is not None]
        ys = [y for y in ys if y is not None]
        stopped = r.get("state") == "EARLY_STOPPED"
        ax.plot(xs, ys, color=cmap(mnorm[i]), alpha=0.85, lw=1.0 if stopped else 2.0, ls="--" if stopped else "-")
    for x, (_, ticks, labels) in enumerate(cols):
        ax.axvline(x, color="gray", lw=0.8)
        for t, lab in zip(ticks, labels):
            ax.annotate(lab, (x, t), xytext=(3, 0), textcoords="offset points", fontsize=7, va="center")
    ax.axvline(len(keys), color="gray", lw=0.8)
    for t, lab in ((0.0, f"{lo:.3g}"), (1.0, f"{hi:.3g}")):
        ax.annotate(lab, (len(keys), t), xytext=(3, 0), textcoords="offset points", fontsize=7, va="center")
    ax.set_xticks(range(len(keys) + 1))
    ax.set_xticklabels(keys + [metric], rotation=20, fontsize=8)
    ax.set_yticks([])
    ax.set_xlim(-0.2, len(keys) + 0.5)
    ax.set_title(f"{len(scored)} trials ({sp.searcher} + {sp.scheduler}); dashed: stopped by ASHA")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def fmt_value(v: Any) -> str:
    """A table cell: floats to 4 significant digits, None as "-"."""
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def trial_table(sp: SearchSpace, records: list[dict[str, Any]]) -> str:
    """Markdown table: trial, each parameter, metric, seconds, epochs, samples seen, stop rung, state, start-up."""
    keys = [p.key for p in sp.params]
    head = ["trial"] + keys + [sp.tune_metric, "time_s", "epochs", "samples_seen", "stop_rung", "state",
                               "first_step_s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        first = (r.get("startup") or {}).get("first_step_s")
        rung = r.get("stop_rung") if r.get("state") == "EARLY_STOPPED" else "-"
        cells = [r["trial_id"]] + [fmt_value(r["params"].get(k)) for k in keys] + [
            *(fmt_value(r.get(k)) for k in ("metric", "time_s", "epochs", "samples_seen")),
            fmt_value(rung), r.get("state", "-"), fmt_value(first)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def write_search_report(exp_dir: str | pathlib.Path) -> dict[str, str]:
    """Write importances, the parallel-coordinates plot and search.md; returns their paths."""
    exp = pathlib.Path(exp_dir)
    sp, records = load_experiment(exp)
    out = exp / "report"
    out.mkdir(exist_ok=True)
    imp = importances(exp, sp)
    (out / IMPORTANCES_FILE).write_text(json.dumps(imp, indent=1))
    plot = plot_parallel(out / PARALLEL_FILE, sp, records, sp.tune_metric)
    md = [f"# Search {exp.name}\n", f"{len(records)} trials; {sp.searcher} + {sp.scheduler} on "
          f"`{sp.tune_metric}` ({sp.tune_mode}).\n", "## Parameter importance (Optuna, fANOVA)\n"]
    md += [f"- `{k}`: {v:.3f}" for k, v in imp.items()] or ["not available (too few finished trials)"]
    md += ["", f"![parallel coordinates]({PARALLEL_FILE})\n", "## Trials\n",
           "`stop_rung`: the ASHA rung (1 = the first) at which the trial was stopped (0: stopped before any "
           "rung, by the search's time budget); `first_step_s`: seconds from the trial's start to its first "
           "training step.\n",
           trial_table(sp, records), ""]
    (out / MARKDOWN_FILE).write_text("\n".join(md))
    return {"importances": str(out / IMPORTANCES_FILE), "parallel_coordinates": str(plot),
            "markdown": str(out / MARKDOWN_FILE)}
