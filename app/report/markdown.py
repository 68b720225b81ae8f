"""``python app/run.py --report PATH``: plots + ``report/report.md`` for a run or a Tune experiment.

PATH is a run folder (``metrics.jsonl``, ``summary.json``) or a Tune experiment folder, recognised by
its ``trials.json``: a list of ``{trial_id, params, metric, time_s, state}`` (or a mapping with that
list under ``"trials"`` and optional ``"metric"``/``"mode"``). A trial's run folder is taken from an
entry's ``run_dir``/``path`` if present, else found as the sub-folder with a metrics.jsonl whose path
names the trial id.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightray import storage
from lightray.report.plots import (
    ReportError,
    RunData,
    load_run,
    plot_accuracy,
    plot_schedule,
    plot_throughput,
    plot_trials,
)
from lightray.report.progress import METRICS_FILE, format_event, summary_rows

REPORT_DIR = "report"
TRIALS_FILE = "trials.json"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def make_report(path: str) -> Path:
    """Render the report for a run folder or a Tune experiment folder; returns the report.md path."""
    p = Path(path)
    if not p.is_dir():
        raise ReportError(f"--report {path}: no such folder; expected a run folder or a Tune experiment folder")
    if (p / TRIALS_FILE).is_file():
        return make_experiment_report(p)
    return make_run_report(p)


def render_anywhere(path: str, render: Callable[[str], list[str]]) -> list[str]:
    """``render(folder) -> paths written`` on a run or experiment folder. PATH may be on object storage: what a
    report reads is copied to a temporary folder, rendered there, and its ``report/`` folder is written back
    beside the run's records; the URIs written are returned, report.md first."""
    if not storage.is_uri(path):
        return render(path)
    import tempfile

    from lightray.report.record_sync import fetch_for_report, push_folder

    with tempfile.TemporaryDirectory(prefix="lightray-report-") as tmp:
        render(fetch_for_report(path, tmp))
        pushed = push_folder(str(Path(tmp) / REPORT_DIR), storage.join(path, REPORT_DIR))
    return sorted(pushed, key=lambda u: not u.split("?")[0].endswith("report.md"))


def make_run_report(run_dir: Path) -> Path:
    run = load_run(run_dir)
    out = run.run_dir / REPORT_DIR
    storage.makedirs(str(out))
    images = [
        ("Accuracy", plot_accuracy(run, out / "accuracy.png")),
        ("Throughput", plot_throughput(run, out / "throughput.png")),
        ("Schedule as run", plot_schedule(run, out / "schedule.png")),
    ]
    md = [f"# lightray run: {run.name}\n", f"Run folder: `{run.run_dir}`\n"]
    if run.summary and run.summary.get("command"):
        md.append(f"Command: `{run.summary['command']}`\n")
    md += [f"> {n}\n" for n in run.notes]
    md.append("## Summary\n")
    rows = summary_rows(run.summary) if run.summary else _summary_from_metrics(run)
    if rows:
        md.append(_table(["figure", "value"], [list(r) for r in rows]))
    else:
        md.append("No training report in metrics.jsonl yet.\n")
    for title, img in images:
        md.append(f"## {title}\n")
        md.append(f"![{title}]({img.name})\n" if img else "No data for this plot in metrics.jsonl.\n")
    md.append("## Events\n")
    if run.events:
        rows = [[_fmt_min(ev.get("_wall_min")), _fmt_epoch(ev.get("_epoch")), ev.get("event"), format_event(ev)]
                for ev in run.events]
        md.append("Restarts are marked as red dashed lines in the plots, resizes as purple dotted lines.\n")
        md.append(_table(["wall time (min)", "epoch", "event", "details"], rows))
    else:
        md.append("No events recorded.\n")
    cfg = (run.summary or {}).get("config")
    if isinstance(cfg, dict):
        import yaml

        md.append("## Resolved config\n")
        md.append("<details><summary>config</summary>\n\n```yaml\n" + yaml.safe_dump(cfg, sort_keys=False)
                  + "```\n</details>\n")
    report = out / "report.md"
    storage.write_text(str(report), "\n".join(md))
    return report


def _fmt_min(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, (int, float)) else "-"


def _fmt_epoch(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, (int, float)) else "-"


def _summary_from_metrics(run: RunData) -> list[tuple[str, str]]:
    """Rows for a run without summary.json: the last figures its metrics.jsonl reported."""
    last: dict[str, Any] = {}
    for rec in run.progress:
        last.update({k: v for k, v in rec.items() if not k.startswith("_")})
    keep = ("val_top1", "val_top5", "val_loss", "samples_seen", "epoch", "images_per_s", "comm_bytes",
            "restarts", "resizes", "world_size", "elapsed_s", "device_seconds")
    return summary_rows({k: last[k] for k in keep if k in last})


# --- Tune experiments ------------------------------------------------------------------------

def read_trials(exp_dir: Path) -> tuple[list[dict[str, Any]], str, str]:
    """Trials, metric name and mode ("max"/"min") from an experiment's trials.json."""
    path = exp_dir / TRIALS_FILE
    try:
        data = storage.read_json(str(path))
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    metric, mode = "val_top1", "max"
    if isinstance(data, dict):
        metric = str(data.get("metric", metric))
        mode = str(data.get("mode", mode))
        data = data.get("trials")
    if not isinstance(data, list):
        raise ReportError(f"{path}: expected a list of trials {{trial_id, params, metric, time_s, state}}, "
                          f"got {type(data).__name__}")
    if mode not in ("max", "min"):
        raise ReportError(f"{path}: mode: bad value {mode!r}; expected max or min")
    for i, t in enumerate(data):
        if not isinstance(t, dict) or "trial_id" not in t:
            raise ReportError(f"{path}: trial [{i}]: expected an object with a trial_id, got {str(t)[:80]!r}")
    return data, metric, mode


def find_trial_dir(exp_dir: Path, trial: dict[str, Any]) -> Path | None:
    for key in ("run_dir", "path", "logdir"):
        if trial.get(key):
            p = Path(str(trial[key]))
            p = p if p.is_absolute() else exp_dir / p
            if (p / METRICS_FILE).is_file():
                return p
    tid = str(trial["trial_id"])
    hits = sorted(m.parent for m in exp_dir.rglob(METRICS_FILE) if tid in str(m.parent.relative_to(exp_dir)))
    return hits[0] if hits else None


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix or "value": d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.update(_flat(v, key) if isinstance(v, dict) else {key: v})
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return "-" if v is None else str(v)


def make_experiment_report(exp_dir: Path) -> Path:
    trials, metric, mode = read_trials(exp_dir)
    out = exp_dir / REPORT_DIR
    storage.makedirs(str(out))
    runs: dict[str, RunData] = {}
    notes: list[str] = []
    for t in trials:
        d = find_trial_dir(exp_dir, t)
        if d is None:
            notes.append(f"trial {t['trial_id']}: no run folder with {METRICS_FILE} found under {exp_dir}")
            continue
        try:
            runs[str(t["trial_id"])] = load_run(d)
        except ReportError as exc:
            notes.append(f"trial {t['trial_id']}: {exc}")
    scored = [t for t in trials if isinstance(t.get("metric"), (int, float)) and not isinstance(t["metric"], bool)
              and math.isfinite(t["metric"])]
    ordered = sorted(scored, key=lambda t: t["metric"], reverse=(mode == "max"))
    ordered += [t for t in trials if t not in scored]
    img = plot_trials(trials, runs, out / "trials.png", metric)

    md = [f"# lightray experiment: {exp_dir.name}\n", f"Experiment folder: `{exp_dir}`\n",
          f"{len(trials)} trials; metric `{metric}` ({mode}).\n"]
    md += [f"> {n}\n" for n in notes]
    if ordered and ordered[0] in scored:
        best = ordered[0]
        md.append(f"Best trial: **{best['trial_id']}** with {metric} = {_fmt(best['metric'])}.\n")
        best_run = runs.get(str(best["trial_id"]))
        if best_run is not None:
            best_md = make_run_report(best_run.run_dir)
            rel = Path("..") / best_md.relative_to(exp_dir)
            md.append(f"Its run report: [{rel}]({rel.as_posix()})\n")
    md.append("## Trials\n")
    md.append(f"![trials]({img.name})\n")
    param_keys: list[str] = []
    for t in ordered:
        for k in _flat(t.get("params") or {}):
            if k not in param_keys:
                param_keys.append(k)
    rows = []
    for t in ordered:
        params = _flat(t.get("params") or {})
        time_s = t.get("time_s")
        rows.append([t["trial_id"], t.get("state", "?"), _fmt(t.get("metric")),
                     _fmt(round(time_s, 1) if isinstance(time_s, (int, float)) else time_s)]
                    + [_fmt(params.get(k)) for k in param_keys])
    md.append(_table(["trial", "state", metric, "time (s)"] + param_keys, rows))
    report = out / "report.md"
    storage.write_text(str(report), "\n".join(md))
    return report
