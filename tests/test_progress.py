"""Console progress: a real thread tailing a real, growing metrics.jsonl into a text stream."""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lightray.report.progress import ProgressPrinter, fmt_duration, quiet_ray_logging

T0 = 1_700_000_000.0


def record(step: int, t: float, **extra: object) -> dict:
    rec = {"step": step, "samples_seen": step * 100, "total_samples": 10_000, "epoch": 0,
           "epoch_progress": step / 10, "phase": 0, "resolution": 64, "batch_size": 100,
           "lr": 0.1, "loss": 3.0 - step / 10, "images_per_s": 50.0, "data_wait_frac": 0.25,
           "restarts": 0, "time": t}
    rec.update(extra)
    return rec


def append(path: Path, *recs: dict) -> None:
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)


def wait_for(cond: Callable[[], bool], what: str, limit_s: float = 30.0) -> None:
    """Wait for the printer thread; the limit only turns a hang into a failure, it measures nothing."""
    deadline = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_not_a_terminal_prints_one_line_per_report_and_events_on_their_own(tmp_path: Path) -> None:
    out = io.StringIO()
    metrics = tmp_path / "metrics.jsonl"
    printer = ProgressPrinter(str(tmp_path), stream=out, tty=False, every_s=0.02).start()
    try:
        for i in range(1, 4):  # the file grows while the printer runs; it does not exist at first
            append(metrics, record(i, T0 + 10 * i))
            wait_for(lambda i=i: out.getvalue().count("\n") == i, f"line {i}")
        append(metrics, {"event": "restart", "restarts": 1, "reason": "node lost", "time": T0 + 40})
        append(metrics, record(4, T0 + 70, restarts=1, val_top1=0.42))
        wait_for(lambda: out.getvalue().count("\n") == 5, "the event and the 4th report")
    finally:
        printer.stop()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 5
    assert [ln.split(" | ")[0] for ln in lines[:3]] == ["ep 0.10", "ep 0.20", "ep 0.30"]
    assert "phase 0 64px bs 100" in lines[0] and "lr 0.1" in lines[0] and "loss 2.9000" in lines[0]
    assert "50 img/s" in lines[0] and "data wait 25%" in lines[0] and "restarts 0" in lines[0]
    assert lines[3].startswith("[restart] node lost") and "restarts=1" in lines[3]
    assert "val top1 42.0%" in lines[4] and "restarts 1" in lines[4]


@pytest.mark.parametrize("verbose", [False, True])
def test_unit_lines_stay_in_the_file_unless_verbose(tmp_path: Path, verbose: bool) -> None:
    out = io.StringIO()
    metrics = tmp_path / "metrics.jsonl"
    printer = ProgressPrinter(str(tmp_path), stream=out, tty=False, every_s=0.02, verbose=verbose).start()
    try:
        append(metrics, {"event": "unit", "unit": "compile", "message": "torch.compile off", "time": T0},
               {"event": "start", "samples_seen": 0, "world_size": 2, "time": T0}, record(1, T0 + 1))
        wait_for(lambda: "ep 0.10" in out.getvalue(), "the report")
    finally:
        printer.stop()
    lines = out.getvalue().splitlines()
    assert lines[-2].startswith("[start]") and lines[-1].startswith("ep 0.10")  # other events still print
    assert any(ln.startswith("[unit] compile torch.compile off") for ln in lines) is verbose, lines


def test_eta_uses_the_rate_since_the_last_restart(tmp_path: Path) -> None:
    out = io.StringIO()
    metrics = tmp_path / "metrics.jsonl"
    printer = ProgressPrinter(str(tmp_path), stream=out, tty=False, every_s=0.02).start()
    try:
        # first report: no clock rate yet, so images_per_s: 9000 left at 50/s -> 180 s.
        # second: 1000 samples in 10 s -> 100/s (the clock wins over images_per_s); 8000 left -> 80 s
        append(metrics, record(10, T0), record(20, T0 + 10))
        wait_for(lambda: out.getvalue().count("\n") == 2, "two reports")
        # after a restart the lost minutes do not count: 1000 samples in 5 s -> 200/s; 7000 left -> 35 s
        append(metrics, {"event": "restart", "time": T0 + 100}, record(20, T0 + 200), record(30, T0 + 205))
        wait_for(lambda: out.getvalue().count("\n") == 5, "the restart and two reports")
    finally:
        printer.stop()
    lines = out.getvalue().splitlines()
    assert "ETA 3m00s" in lines[0]
    assert "ETA 1m20s" in lines[1]
    assert lines[2].startswith("[restart]")
    assert "ETA 35s" in lines[4]


def test_terminal_mode_draws_one_live_bar_with_the_watched_figures_and_events_above_it(tmp_path: Path) -> None:
    out = io.StringIO()
    metrics = tmp_path / "metrics.jsonl"
    printer = ProgressPrinter(str(tmp_path), stream=out, tty=True, every_s=0.02).start()
    try:
        for i in range(1, 4):
            append(metrics, record(i, T0 + i))
            wait_for(lambda i=i: f"ep {i / 10:.2f}" in out.getvalue(), f"report {i}")
        assert "\n" not in out.getvalue()  # redrawn in place, never scrolled
        append(metrics, {"step": 3, "val_top1": 0.625, "time": T0 + 3.5},
               {"event": "resize", "from": 2, "to": 1, "time": T0 + 5}, record(4, T0 + 6, phase=1, resolution=96))
        wait_for(lambda: "ep 0.40" in out.getvalue(), "the report after the event")
    finally:
        printer.stop()
    text = out.getvalue()
    draws = [d for d in text.split("\r") if "%|" in d]
    # 4% of 10,000 samples, where the run is, and the figures a user watches
    assert draws[-1].startswith("ep 0.40 phase 1 96px   4%|")
    assert "| loss 2.6000 | 50 img/s | top1 62.5% |" in draws[-1]
    assert "ETA " in draws[-1] and "lr " not in draws[-1]  # the bar keeps to the watched figures
    # the event gets a whole line of its own above the bar, which is drawn again below it; stop() ends the line
    before, after = text.split("[resize] from=2 to=1\n")
    assert before.endswith("\r") and after.startswith("\rep 0.30") and text.endswith("\n")
    assert text.count("\n") == 2


def test_partial_line_is_printed_once_when_completed(tmp_path: Path) -> None:
    out = io.StringIO()
    metrics = tmp_path / "metrics.jsonl"
    line = json.dumps(record(5, T0))
    metrics.write_text(line[:20])
    printer = ProgressPrinter(str(tmp_path), stream=out, tty=False, every_s=0.02, replay=True)
    printer.poll()
    assert out.getvalue() == ""
    with open(metrics, "a") as f:
        f.write(line[20:] + "\n")
    printer.poll()
    printer.poll()
    assert out.getvalue().count("ep 0.50") == 1


def test_history_of_a_resumed_run_is_not_reprinted_but_remembered(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    append(metrics, record(1, T0, val_top1=0.3), record(2, T0 + 1))
    out = io.StringIO()
    with ProgressPrinter(str(tmp_path), stream=out, tty=False, every_s=0.02):
        append(metrics, record(3, T0 + 2))
        wait_for(lambda: out.getvalue().count("\n") >= 1, "the new report")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ep 0.30")
    assert "val top1 30.0%" in lines[0]


def test_a_line_that_is_not_json_is_reported_and_skipped(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("garbage\n" + json.dumps(record(1, T0)) + "\n")
    out = io.StringIO()
    printer = ProgressPrinter(str(tmp_path), stream=out, tty=False, replay=True)
    printer.poll()
    lines = out.getvalue().splitlines()
    assert "metrics.jsonl: skipped a line that is not JSON" in lines[0]
    assert lines[1].startswith("ep 0.10")


def test_bad_interval_is_rejected_with_its_value(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"every_s: bad value 0"):
        ProgressPrinter(str(tmp_path), every_s=0)


def test_durations_read_as_hours_minutes_seconds() -> None:
    assert [fmt_duration(x) for x in (5, 65, 3725, None, float("nan"))] == ["5s", "1m05s", "1h02m", "?", "?"]


def test_quiet_ray_logging_turns_ray_noise_off_and_verbose_back_on() -> None:
    from ray.data import DataContext

    ctx = DataContext.get_current()
    saved = (ctx.enable_progress_bars, ctx.enable_operator_progress_bars, logging.getLogger("ray.train").level)
    try:
        kwargs = quiet_ray_logging(verbose=False)
        assert kwargs == {"log_to_driver": False, "logging_level": logging.WARNING}
        assert not ctx.enable_progress_bars and not ctx.enable_operator_progress_bars
        assert logging.getLogger("ray.data").level == logging.WARNING
        kwargs = quiet_ray_logging(verbose=True)
        assert kwargs["log_to_driver"] is True and ctx.enable_progress_bars
        assert logging.getLogger("ray.train").level == logging.INFO
    finally:
        ctx.enable_progress_bars, ctx.enable_operator_progress_bars = saved[0], saved[1]
        logging.getLogger("ray.train").setLevel(saved[2])


@pytest.mark.own_cluster
def test_quiet_ray_logging_kwargs_start_a_real_cluster() -> None:
    import ray

    # This test needs a cluster started with the kwargs it checks: end the session's cluster, if one is up (the
    # own_cluster marker runs it after every test that shares it; conftest starts it again for a later user).
    ray.shutdown()
    assert not ray.is_initialized()
    ray.init(address="local", num_cpus=1, include_dashboard=False, **quiet_ray_logging(verbose=False))
    try:
        assert ray.get(ray.put(7)) == 7
    finally:
        ray.shutdown()
