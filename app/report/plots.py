"""PNG plots of a run (and of a Tune experiment) from metrics.jsonl + summary.json.

The x axis "wall time" is minutes since the run's first record, from each line's unix ``time``:
a restart's lost minutes stay visible as a gap instead of being folded away, which is what a
reader of a spot run wants to see. Restarts are red dashed vertical lines, resizes purple dotted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on cluster heads or CI
import matplotlib.pyplot as plt

from lightray import storage
from lightray.report.progress import METRICS_FILE, read_metrics

SUMMARY_FILE = "summary.json"
MARKS = {  # event -> (color, linestyle, legend label)
    "restart": ("tab:red", "--", "restart"),
    "resize": ("tab:purple", ":", "resize"),
    "preemption_checkpoint": ("tab:orange", "-.", "preemption checkpoint"),
}


class ReportError(ValueError):
    """A folder or file the report cannot be made from; the message names it and what was expected."""


@dataclass
class RunData:
    run_dir: Path
    name: str
    progress: list[dict[str, Any]]  # report lines (no "event" key), in file order
    events: list[dict[str, Any]]  # event lines, each with "_wall_min" and "_epoch" added
    summary: dict[str, Any] | None
    notes: list[str] = field(default_factory=list)

    @property
    def val(self) -> list[dict[str, Any]]:
        return [r for r in self.progress if _is_num(r.get("val_top1"))]

    @property
    def train(self) -> list[dict[str, Any]]:
        """Training reports. Validation lines repeat the last step's figures at a later time, so they are
        left out unless there is nothing else (a report interval longer than an epoch)."""
        rows = [r for r in self.progress if _is_num(r.get("loss")) or _is_num(r.get("images_per_s"))]
        steps = [r for r in rows if not _is_num(r.get("val_top1"))]
        return steps or rows

    def targets(self) -> list[float]:
        """Top-1 targets from the resolved config (summary.json, else config.yaml)."""
        cfg = (self.summary or {}).get("config")
        if not isinstance(cfg, dict):
            cfg = _read_yaml(self.run_dir / "config.yaml")
        targets = ((cfg or {}).get("report") or {}).get("targets") or []
        return [float(t) for t in targets if _is_num(t)]


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _read_yaml(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    import yaml

    try:
        data = yaml.safe_load(storage.read_text(str(path)))
    except yaml.YAMLError:
        return None
    return data if isinstance(data, dict) else None


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / SUMMARY_FILE
    if not path.is_file():
        return None
    try:
        data = storage.read_json(str(path))
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); "
                          "expected the run summary") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load_run(run_dir: str | Path) -> RunData:
    """Read a run folder; raises ReportError if it has no metrics.jsonl."""
    d = Path(run_dir)
    if not d.is_dir():
        raise ReportError(f"{d}: no such folder; expected a run folder <storage>/<name>/")
    if not (d / METRICS_FILE).is_file():
        raise ReportError(f"{d}: no {METRICS_FILE}; expected a run folder (<storage>/<name>/) or a Tune "
                          "experiment folder with trials.json")
    try:
        records, notes = read_metrics(d / METRICS_FILE)
    except ValueError as exc:
        raise ReportError(str(exc)) from None
    summary = read_summary(d)
    if summary is None:
        notes.append(f"{d / SUMMARY_FILE} is missing (run still going or stopped early); figures come from "
                     f"{METRICS_FILE} alone")
    times = [r["time"] for r in records if _is_num(r.get("time"))]
    t0 = min(times) if times else None
    progress: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    last: dict[str, Any] = {}
    attempt = 0  # worker-group attempt: lines are not drawn across a restart's downtime
    for rec in records:
        rec = dict(rec)
        if rec.get("event") == "restart":
            attempt += 1
        rec["_attempt"] = attempt
        rec["_wall_min"] = _wall_min(rec, t0, last)
        ep = rec.get("epoch_progress", rec.get("epoch"))
        rec["_epoch"] = float(ep) if _is_num(ep) else last.get("_epoch")
        if "event" in rec:
            events.append(rec)
        else:
            progress.append(rec)
            last = rec
    name = str((summary or {}).get("run_name") or (summary or {}).get("name") or d.name)
    return RunData(d, name, progress, events, summary, notes)


def _wall_min(rec: dict[str, Any], t0: float | None, last: dict[str, Any]) -> float | None:
    if t0 is not None and _is_num(rec.get("time")):
        return (rec["time"] - t0) / 60.0
    if _is_num(rec.get("elapsed_s")):
        return rec["elapsed_s"] / 60.0
    return last.get("_wall_min")  # an event without a clock happened after the previous report


# --- drawing ---------------------------------------------------------------------------------

def _mark_events(ax: Any, events: list[dict[str, Any]], xkey: str, labelled: set[str]) -> None:
    for ev in events:
        style = MARKS.get(str(ev.get("event")))
        x = ev.get(xkey)
        if style is None or x is None:
            continue
        color, ls, label = style
        ax.axvline(x, color=color, linestyle=ls, linewidth=1.2, alpha=0.8,
                   label=label if label not in labelled else None)
        labelled.add(label)


def _series(rows: list[dict[str, Any]], xkey: str, ykey: str) -> tuple[list[float], list[float]]:
    """Points of ``ykey`` over ``xkey``, with a NaN break where a restart separates two points."""
    xs: list[float] = []
    ys: list[float] = []
    prev = None
    for r in rows:
        x, y = r.get(xkey), r.get(ykey)
        if x is None or not _is_num(y):
            continue
        if prev is not None and r.get("_attempt") != prev:
            xs.append(float("nan"))
            ys.append(float("nan"))
        prev = r.get("_attempt")
        xs.append(x)
        ys.append(float(y))
    return xs, ys


def _save(fig: Any, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def plot_accuracy(run: RunData, out: Path) -> Path | None:
    """Validation top-1/top-5 against wall time and against epochs; None if nothing was validated."""
    val = run.val
    if not val:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, xkey, xlabel in ((axes[0], "_wall_min", "wall time (min)"), (axes[1], "_epoch", "epoch")):
        labelled: set[str] = set()
        for ykey, label, marker in (("val_top1", "top-1", "o"), ("val_top5", "top-5", "s")):
            xs, ys = _series(val, xkey, ykey)
            if xs:
                ax.plot(xs, [100 * y for y in ys], marker=marker, markersize=4, label=label)
        for t in run.targets():
            ax.axhline(100 * t, color="grey", linewidth=0.8, linestyle=(0, (4, 4)))
            ax.annotate(f"target {t:.0%}", (0.01, 100 * t), xycoords=("axes fraction", "data"),
                        fontsize=8, color="grey", va="bottom")
        _mark_events(ax, run.events, xkey, labelled)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation accuracy (%)")
    axes[0].set_ylim(0, 100)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{run.name}: accuracy")
    return _save(fig, out)


def plot_throughput(run: RunData, out: Path) -> Path | None:
    """Images/s and the fraction of step time spent waiting for data, against wall time."""
    train = run.train
    xs, ips = _series(train, "_wall_min", "images_per_s")
    if not xs:
        return None
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True, height_ratios=(2, 1))
    ax.plot(xs, ips, color="tab:blue", label="images/s")
    ax.set_ylabel("images / s")
    ax.set_ylim(bottom=0)
    wx, wy = _series(train, "_wall_min", "data_wait_frac")
    if wx:
        ax2.plot(wx, [100 * y for y in wy], color="tab:green", label="data wait")
    ax2.set_ylabel("data wait (%)")
    ax2.set_ylim(0, 100)
    ax2.set_xlabel("wall time (min)")
    for a in (ax, ax2):
        labelled: set[str] = set()
        _mark_events(a, run.events, "_wall_min", labelled)
        a.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{run.name}: throughput")
    return _save(fig, out)


def plot_schedule(run: RunData, out: Path) -> Path | None:
    """LR, resolution and global batch size as they were run, against wall time."""
    train = run.train
    panels = [(k, lab) for k, lab in (("lr", "learning rate"), ("resolution", "resolution (px)"),
                                       ("batch_size", "global batch")) if _series(train, "_wall_min", k)[0]]
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.2 * len(panels) + 0.8), sharex=True, squeeze=False)
    for ax, (key, label) in zip(axes[:, 0], panels, strict=True):
        xs, ys = _series(train, "_wall_min", key)
        if key == "lr":
            ax.plot(xs, ys, color="tab:blue")
        else:  # resolution and batch change in steps at phase boundaries
            ax.step(xs, ys, where="post", color="tab:brown")
            ax.set_ylim(0, max(y for y in ys if y == y) * 1.15)  # y == y: skip the NaN breaks
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        labelled: set[str] = set()
        _mark_events(ax, run.events, "_wall_min", labelled)
    axes[-1, 0].set_xlabel("wall time (min)")
    if any(ev.get("event") in MARKS for ev in run.events):
        axes[0, 0].legend(loc="upper right", fontsize=8)
    fig.suptitle(f"{run.name}: schedule as run")
    return _save(fig, out)


def plot_trials(trials: list[dict[str, Any]], runs: dict[str, RunData], out: Path, metric_name: str) -> Path:
    """Left: each trial's validation top-1 over wall time. Right: each trial's final metric."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for tid, run in runs.items():
        xs, ys = _series(run.val, "_wall_min", "val_top1")
        if xs:
            ax.plot(xs, [100 * y for y in ys], marker=".", label=tid)
    ax.set_xlabel("wall time (min)")
    ax.set_ylabel("validation top-1 (%)")
    ax.set_title("trials over time")
    ax.grid(alpha=0.3)
    if 0 < len(runs) <= 12:
        ax.legend(fontsize=7)
    colors = {"TERMINATED": "tab:green", "ERROR": "tab:red", "RUNNING": "tab:blue", "PENDING": "tab:grey"}
    for i, t in enumerate(trials):
        m = t.get("metric")
        state = str(t.get("state", "?"))
        if _is_num(m):
            ax2.bar(i, m, color=colors.get(state, "tab:orange"), label=state)
        else:  # no metric (failed before its first report): a cross on the axis, so it is not just absent
            ax2.scatter([i], [0], marker="x", s=60, color=colors.get(state, "tab:orange"), label=state,
                        clip_on=False, zorder=3)
    handles, labels = ax2.get_legend_handles_labels()
    uniq = dict(zip(labels, handles, strict=True))
    if uniq:
        ax2.legend(uniq.values(), uniq.keys(), fontsize=8)
    ax2.set_xticks(range(len(trials)))
    ax2.set_xticklabels([str(t.get("trial_id", i)) for i, t in enumerate(trials)], rotation=45, ha="right",
                        fontsize=7)
    ax2.set_ylabel(metric_name)
    ax2.set_title("final metric per trial (colour = state)")
    ax2.grid(alpha=0.3, axis="y")
    return _save(fig, out)
