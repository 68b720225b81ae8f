"""Console view of a run: a progress line fed from ``<run_dir>/metrics.jsonl``, the final table, quiet Ray.

The driver blocks in ``trainer.fit()`` while rank 0 appends one JSON line per report to
``metrics.jsonl`` (docs/INTERFACES.md). ``ProgressPrinter`` tails that file from a thread, so the
console needs nothing from the workers but the file they write anyway: the same view works for a
local run, a cluster run on shared storage, and a resumed run.

On a terminal one live tqdm bar over the run's samples is redrawn in place, with the figures a user
watches (epoch, phase, loss, img/s, last top-1, ETA); into a pipe or log file (a cluster job) each
report becomes one line, since carriage returns make logs unreadable. Events (restart, resize,
preemption_checkpoint, ...) always get a line of their own, above the bar.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any, TextIO

from lightray import storage

METRICS_FILE = "metrics.jsonl"
CLEAR_LINE = "\x1b[2K"  # ANSI erase-line: the new line may be shorter than the old one


class MetricsFileError(ValueError):
    """A metrics.jsonl that cannot be read; the message names the file, line and what was expected."""


# --- reading metrics.jsonl -------------------------------------------------------------------

def read_metrics(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """All records of a metrics.jsonl, and notes about lines that were skipped.

    A run killed mid-write can leave a truncated last line: it is skipped with a note. A bad line
    anywhere else means the file is not what the training loop writes, and raises MetricsFileError.
    """
    name = str(path) if storage.is_uri(str(path)) else str(Path(path))
    if storage.file_size(name) is None:
        raise MetricsFileError(f"{name}: file not found; expected the metrics.jsonl a run writes")
    try:
        return storage.parse_jsonl(storage.read_text(name, errors="replace"), name)
    except storage.JsonlError as exc:
        raise MetricsFileError(str(exc)) from None


class _Tail:
    """Incremental reader of a file that another process appends to (and may replace on a fresh run)."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0
        self.partial = b""  # a line whose newline has not been written yet
        self.bad_lines = 0

    def read_new(self) -> list[dict[str, Any]]:
        size = storage.file_size(self.path)
        if size is None:
            return []
        if size < self.offset:  # truncated or replaced: start over
            self.offset, self.partial = 0, b""
        if size == self.offset:
            return []
        try:
            chunk = storage.read_bytes(self.path, offset=self.offset)
        except FileNotFoundError:  # replaced between the size check and the read: next poll sees the new one
            return []
        self.offset += len(chunk)
        data = self.partial + chunk
        *complete, self.partial = data.split(b"\n")
        out = []
        for raw in complete:
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError:
                self.bad_lines += 1
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out


# --- formatting ----------------------------------------------------------------------------

def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def fmt_count(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}" if abs(x) >= 10 else f"{x:.1f}"


def fmt_bytes(x: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def _num(rec: dict[str, Any], key: str) -> float | None:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def format_event(rec: dict[str, Any]) -> str:
    """One line for an event record: its name, what it names, then its other scalar fields."""
    name = str(rec.get("event"))
    skip = {"event", "time"}
    head = [f"[{name}]"]
    for key in ("unit", "name"):
        if key in rec:
            head.append(str(rec[key]))
            skip.add(key)
    for key in ("message", "detail", "reason"):
        if key in rec:
            head.append(str(rec[key]))
            skip.add(key)
    rest = [f"{k}={_short(v)}" for k, v in rec.items()
            if k not in skip and not k.startswith("_") and not isinstance(v, (dict, list))]
    line = " ".join(head + rest)
    return line if len(line) <= 240 else line[:237] + "..."


def _position(rec: dict[str, Any]) -> str:
    """Where a progress record is: its epoch to two places, or its step when it has no epoch."""
    ep = _num(rec, "epoch_progress")
    if ep is None:
        ep = _num(rec, "epoch")
    return f"ep {ep:.2f}" if ep is not None else f"step {rec.get('step')}"


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# --- the printer ---------------------------------------------------------------------------

QUIET_EVENTS = frozenset({"unit"})  # printed with --verbose only; metrics.jsonl keeps them all

class ProgressPrinter:
    """Tails ``<run_dir>/metrics.jsonl`` in a thread and prints progress while the driver blocks.

    ``tty=None`` asks the stream. Lines already in the file when ``start()`` runs (a resumed run's
    history) set the state (last validation, ETA anchor) but are not printed unless ``replay``.
    """

    def __init__(self, run_dir: str, stream: TextIO = sys.stdout, tty: bool | None = None,
                 every_s: float = 1.0, replay: bool = False, verbose: bool = False):
        if every_s <= 0:
            raise ValueError(f"every_s: bad value {every_s!r}; expected seconds > 0")
        self.run_dir = str(run_dir)
        self.stream = stream
        if tty is None:
            isatty = getattr(stream, "isatty", None)
            tty = bool(isatty and isatty())
        self.tty = tty
        self.every_s = every_s
        self.replay = replay
        # Unit lines (what each speed-up did, about 40 at a start) stay in metrics.jsonl unless asked for.
        self.verbose = verbose
        self._tail = _Tail(storage.join(self.run_dir, METRICS_FILE))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._last: dict[str, Any] | None = None  # last progress record
        self._val: dict[str, float] = {}  # last validation figures
        self._anchor: tuple[float, float] | None = None  # (samples_seen, time) for the ETA rate
        self._shown = ""  # what the in-place line currently shows (a record without a sample total)
        self._bar: _LiveBar | None = None  # the terminal's live bar, made at the first record with a total
        self._warned_bad = 0

    # lifecycle
    def start(self) -> ProgressPrinter:
        if self._thread is not None:
            return self
        if not self.replay:
            for rec in self._tail.read_new():
                self._absorb(rec)
        self._thread = threading.Thread(target=self._run, name="lightray-progress", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread, print what arrived since the last poll, and end the in-place line."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.poll()
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            if self.tty and self._shown:
                self.stream.write("\n")
                self._shown = ""
            self.stream.flush()

    def __enter__(self) -> ProgressPrinter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.poll()
            except Exception as exc:  # a display problem must never take the training run down
                self._write_line(f"[progress] stopped updating: {exc!r}")
                return

    # one round: read new records and print them
    def poll(self) -> None:
        with self._lock:
            new = self._tail.read_new()
            if self._tail.bad_lines > self._warned_bad:
                self._warned_bad = self._tail.bad_lines
                self._write_line(f"[progress] {self._tail.path}: skipped a line that is not JSON")
            latest = None
            for rec in new:
                self._absorb(rec)
                if "event" in rec:
                    if self.verbose or rec.get("event") not in QUIET_EVENTS:
                        self._write_line(format_event(rec))
                elif not self.tty:
                    self._write_line(self.format_progress(rec))
                else:
                    latest = rec
            if self.tty and latest is not None:
                self._show(latest)

    def _absorb(self, rec: dict[str, Any]) -> None:
        if "event" in rec:
            if rec.get("event") in ("restart", "resize", "start"):
                self._anchor = None  # time spent restarting is not training throughput
            return
        for k in ("val_top1", "val_top5", "val_loss"):
            v = _num(rec, k)
            if v is not None:
                self._val[k] = v
        self._last = rec
        seen, t = _num(rec, "samples_seen"), _num(rec, "time")
        if self._anchor is None and seen is not None and t is not None:
            self._anchor = (seen, t)

    def eta_s(self, rec: dict[str, Any]) -> float | None:
        """Seconds left: samples still to go over the rate seen since the last (re)start."""
        total, seen = _num(rec, "total_samples"), _num(rec, "samples_seen")
        if total is None or seen is None:
            return None
        left = max(0.0, total - seen)
        rate = None
        t = _num(rec, "time")
        if self._anchor is not None and t is not None and t > self._anchor[1] and seen > self._anchor[0]:
            rate = (seen - self._anchor[0]) / (t - self._anchor[1])
        if rate is None:
            rate = _num(rec, "images_per_s")
        if not rate or rate <= 0:
            return None
        return left / rate

    def format_progress(self, rec: dict[str, Any]) -> str:
        parts: list[str] = [_position(rec)]
        sched = []
        if "phase" in rec:
            sched.append(f"phase {rec['phase']}")
        if "resolution" in rec:
            sched.append(f"{rec['resolution']}px")
        if "batch_size" in rec:
            sched.append(f"bs {rec['batch_size']}")
        if sched:
            parts.append(" ".join(sched))
        for key, label, fmt in (("lr", "lr", "{:.4g}"), ("loss", "loss", "{:.4f}")):
            v = _num(rec, key)
            if v is not None:
                parts.append(f"{label} {fmt.format(v)}")
        ips = _num(rec, "images_per_s")
        if ips is not None:
            parts.append(f"{fmt_count(ips)} img/s")
        wait = _num(rec, "data_wait_frac")
        if wait is not None:
            parts.append(f"data wait {wait:.0%}")
        if "val_top1" in self._val:
            parts.append(f"val top1 {self._val['val_top1']:.1%}")
        eta = self.eta_s(rec)
        if eta is not None:
            parts.append(f"ETA {fmt_duration(eta)}")
        restarts = rec.get("restarts")
        if restarts is not None:
            parts.append(f"restarts {restarts}")
        return " | ".join(parts)

    def bar_text(self, rec: dict[str, Any]) -> tuple[str, str]:
        """(left, right) of the terminal's bar: where the run is, then the figures a user watches."""
        left = [_position(rec)]
        if "phase" in rec:
            left.append(f"phase {rec['phase']}")
        if "resolution" in rec:
            left.append(f"{rec['resolution']}px")
        right = []
        loss, ips = _num(rec, "loss"), _num(rec, "images_per_s")
        if loss is not None:
            right.append(f"loss {loss:.4f}")
        if ips is not None:
            right.append(f"{fmt_count(ips)} img/s")
        if "val_top1" in self._val:
            right.append(f"top1 {self._val['val_top1']:.1%}")
        eta = self.eta_s(rec)
        if eta is not None:
            right.append(f"ETA {fmt_duration(eta)}")
        if rec.get("restarts"):
            right.append(f"restarts {rec['restarts']}")
        return " ".join(left), " | ".join(right)

    # output
    def _show(self, rec: dict[str, Any]) -> None:
        total, seen = _num(rec, "total_samples"), _num(rec, "samples_seen")
        if not total or seen is None:  # nothing to draw a bar against: the plain in-place line
            self._draw(self.format_progress(rec))
            return
        if self._bar is None:
            if self._shown:
                self.stream.write("\r" + CLEAR_LINE)
                self._shown = ""
            self._bar = _LiveBar(self.stream)
        self._bar.show(*self.bar_text(rec), done=min(seen, total), total=total)

    def _write_line(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)
            return
        if self.tty and self._shown:
            self.stream.write("\r" + CLEAR_LINE)
        self.stream.write(line + "\n")
        if self.tty and self._shown:
            self.stream.write(self._shown)  # put the progress line back under the event
        self.stream.flush()

    def _draw(self, line: str) -> None:
        # A line wider than the terminal wraps, and "\r" then only rewinds the last row.
        width = shutil.get_terminal_size((120, 24)).columns
        if len(line) >= width:
            line = line[: max(1, width - 2)] + "…"
        self._shown = line
        self.stream.write("\r" + CLEAR_LINE + line)
        self.stream.flush()


class _LiveBar:
    """The terminal's one live line: a tqdm bar over the run's samples (tqdm fits it to the terminal's width)."""

    FORMAT = "{desc} {percentage:3.0f}%|{bar}| {right}"

    def __init__(self, stream: TextIO):
        from tqdm import tqdm  # a terminal only: a cluster job's log never draws a bar

        class Bar(tqdm):
            right = ""

            @property
            def format_dict(self) -> dict[str, Any]:  # tqdm's documented way to add a field to bar_format
                return {**super().format_dict, "right": self.right}

        # Driven by hand from the metrics records (their samples, and an ETA that time spent restarting does not
        # skew), not by tqdm's own clock. Drawn first by show(), not at construction.
        self._bar = Bar(total=1, file=stream, bar_format=self.FORMAT, dynamic_ncols=True, leave=True,
                        mininterval=0, miniters=0, smoothing=0, delay=float("inf"))

    def show(self, left: str, right: str, done: float, total: float) -> None:
        self._bar.total, self._bar.n = total, done
        self._bar.right = right
        self._bar.set_description_str(left, refresh=False)
        self._bar.refresh()

    def write(self, line: str) -> None:
        """A line of its own above the bar; the bar is drawn again below it."""
        self._bar.clear()
        self._bar.fp.write(line + "\n")
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()
        self._bar.fp.write("\n")  # the last state stays on screen (tqdm leaves a bar it was not asked to draw)


# --- final table ---------------------------------------------------------------------------

_FIRST_KEYS = (  # summary.json keys (app/report/summary.py) in reading order
    "run_name", "name", "status", "error", "final_top1", "final_top5", "best_top1", "best_top5", "time_to_target_s",
    "wall_time_s", "train_time_s", "train_images_per_s", "epochs", "epochs_planned", "samples_seen", "comm_mode",
    "comm_bytes_per_worker", "restarts", "resizes", "preemption_checkpoints", "lost_work", "device_seconds", "cost",
)
_SKIP_KEYS = {"config"}  # the resolved config is saved beside it; a table row would be unreadable


def _fmt_value(key: str, v: Any) -> str:
    """Format by what the (dotted) key names: fractions as %, seconds as durations, bytes, dollars."""
    k = key.lower()
    last = k.rsplit(".", 1)[-1]
    if v is None:
        return "not reached" if "target" in k else "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if ("top1" in k or "top5" in k or "acc" in last or last.endswith("_frac")) and 0.0 <= v <= 1.0:
            return f"{v:.2%}"
        if "bytes" in k:
            return fmt_bytes(v)
        if "usd" in last or "price" in k or last == "cost":
            return f"${v:,.2f}"
        if last.endswith("hours"):
            return f"{v:,.3f} h"
        if "per_s" in k:
            return f"{v:,.1f}"
        if last.endswith("_s") or "seconds" in last or "time_to" in k:
            return f"{fmt_duration(v)} ({v:,.1f} s)"
        if isinstance(v, float):
            return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
        return f"{v:,}"
    if isinstance(v, list):
        if not v:
            return "none"
        text = ", ".join(_fmt_value(key, x) for x in v)
    else:
        text = str(v)
    return text if len(text) <= 100 else text[:97] + "..."


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, formatted value) rows for a summary.json: known keys first, nested mappings dotted."""
    keys = [k for k in _FIRST_KEYS if k in summary] + [k for k in summary if k not in _FIRST_KEYS]
    rows: list[tuple[str, str]] = []
    for k in keys:
        if k in _SKIP_KEYS:
            continue
        v = summary[k]
        if isinstance(v, dict):
            for sub, sv in v.items():
                if isinstance(sv, dict):  # deeper structure: keep the row, not the detail
                    sv = json.dumps(sv, sort_keys=True)
                rows.append((f"{k}.{sub}", _fmt_value(f"{k}.{sub}", sv)))
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            rows.append((k, f"{len(v)} entries"))
        else:
            rows.append((k, _fmt_value(k, v)))
    return rows


# The rows a person reads at the end of a run (prefixes of the dotted labels); summary.json keeps every figure.
HEADLINE_ROWS = ("run_name", "name", "status", "error", "final_top1", "final_top5", "best_top1", "time_to_target_s",
                 "wall_time_s", "train_time_s", "train_images_per_s", "epochs", "restarts", "resizes",
                 "preemption_checkpoints", "lost_work", "cost.usd", "run_dir")


def headline_rows(rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The rows of ``rows`` named in HEADLINE_ROWS (a dotted label by its first part, or whole), in their order."""
    def wanted(label: str) -> bool:
        return label in HEADLINE_ROWS or label.split(".", 1)[0] in HEADLINE_ROWS

    return [r for r in rows if wanted(r[0])]


def print_summary_table(summary: dict[str, Any], stream: TextIO = sys.stdout, verbose: bool = True) -> None:
    """The final table of a run, from its summary.json contents: every row, or (``verbose`` False) the headline
    rows and the file that holds the rest."""
    if not isinstance(summary, dict):
        raise TypeError(f"summary: expected the summary.json mapping, got {type(summary).__name__}")
    rows = summary_rows(summary)
    if not verbose:
        rows = headline_rows(rows)
    width = max((len(k) for k, _ in rows), default=10)
    vwidth = max((len(v) for _, v in rows), default=10)
    rule = "-" * (width + vwidth + 3)
    title = f"lightray run {summary.get('run_name') or summary.get('name') or ''}".rstrip()
    stream.write(f"{rule}\n{title}\n{rule}\n")
    stream.writelines(f"{k:<{width}} | {v}\n" for k, v in rows)
    stream.write(rule + "\n")
    if not verbose:
        stream.write("every figure: summary.json in the run's folder (--verbose prints them all here)\n")
    stream.flush()


# --- Ray's own output ----------------------------------------------------------------------

_RAY_LOGGERS = ("ray", "ray.train", "ray.tune", "ray.data", "ray.serve")


def quiet_ray_logging(verbose: bool = False) -> dict[str, Any]:
    """Keep Ray's own log noise out of the progress view; returns kwargs for ``ray.init``.

    Call before ``ray.init`` and before constructing the TorchTrainer (it copies the DataContext).
    With ``verbose`` Ray keeps its defaults: worker output, INFO logs and Ray Data progress bars.
    """
    level = logging.INFO if verbose else logging.WARNING
    # Read by the driver's log monitor and inherited by a local cluster's processes.
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    for name in _RAY_LOGGERS:
        logging.getLogger(name).setLevel(level)
    # Ray Data warns once that its progress bars are off, which is what this asks for. (A module's logger name:
    # should Ray move the module, the warning comes back; nothing else changes.)
    logging.getLogger("ray.data._internal.progress").setLevel(logging.INFO if verbose else logging.ERROR)
    try:
        from ray.data import DataContext

        ctx = DataContext.get_current()
        ctx.enable_progress_bars = verbose
        ctx.enable_operator_progress_bars = verbose
    except ImportError:  # Ray Data not installed: nothing to quiet
        pass
    # Worker stdout is noise here: progress comes from metrics.jsonl and failures arrive as exceptions.
    return {"log_to_driver": verbose, "logging_level": level}
