"""Report side of a run: TensorBoard events, plots + report.md, experiment report, MLflow params.

Fixtures are real files written the way the training loop writes them (docs/INTERFACES.md):
metrics.jsonl lines, summary.json, config.yaml and TensorBoard event files.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

from lightray.config import Config
from lightray.report.markdown import make_report
from lightray.report.mlflow_log import MissingExtraError, flatten_params, log_run
from lightray.report.plots import ReportError
from lightray.report.progress import print_summary_table
from lightray.report.tensorboard_log import TBLogger, read_scalars

REPO = Path(__file__).resolve().parents[1]
T0 = 1_700_000_000.0
TOTAL = 8 * 2560


def train_line(step: int, t: float, restarts: int = 0, **extra: object) -> dict:
    seen = step * 256
    epoch_progress = seen / 2560
    phase = 0 if epoch_progress < 4 else 1
    rec = {"step": step, "samples_seen": seen, "total_samples": TOTAL, "epoch": int(epoch_progress),
           "epoch_progress": epoch_progress, "phase": phase, "resolution": [32, 64][phase],
           "batch_size": 256, "lr": 0.4 * min(1.0, (step + 1) / 10), "momentum": 0.9,
           "loss": 2.3 - 0.02 * step, "images_per_s": 900.0 + step, "data_wait_frac": 0.1,
           "comm_bytes": 1e6 * step, "comm_mode": "dense", "restarts": restarts, "resizes": 0,
           "world_size": 2, "device_seconds": 2.0 * step, "elapsed_s": t - T0, "time": t}
    rec.update(extra)
    return rec


def write_run(run_dir: Path, restarts_at: tuple[int, ...] = (), summary: bool = True) -> Path:
    """A finished 8-epoch run: a report every 5 steps, validation every 10, restarts at the given steps."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines: list[dict] = [{"event": "start", "time": T0, "world_size": 2}]
    t = T0
    restarts = 0
    for step in range(5, 81, 5):
        t += 6.0
        if step in restarts_at:
            restarts += 1
            lines.append({"event": "restart", "time": t, "restarts": restarts, "reason": "node lost",
                          "world_size": 1})
            t += 30.0  # minutes lost to the restart show as a gap in wall time
        extra = {}
        if step % 10 == 0:
            extra = {"val_top1": min(0.95, 0.1 + step / 100), "val_top5": min(0.99, 0.4 + step / 150),
                     "val_loss": 2.0 - step / 50}
        lines.append(train_line(step, t, restarts=restarts, **extra))
        if step == 40:
            lines.append({"event": "unit", "unit": "progressive_resize", "message": "resolution 32 -> 64",
                          "time": t})
    lines.append({"event": "end", "time": t})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = Config(name=run_dir.name).to_dict()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    if summary:
        # the keys app/report/summary.py writes
        (run_dir / "summary.json").write_text(json.dumps({
            "run_name": run_dir.name, "run_dir": str(run_dir), "status": "finished", "error": None,
            "wall_time_s": t - T0, "train_time_s": t - T0 - 30.0 * restarts, "epochs": 8, "epochs_planned": 8,
            "samples_seen": 80 * 256, "final_top1": 0.9, "final_top5": 0.99, "best_top1": 0.9, "best_top5": 0.99,
            "train_images_per_s": 950.5, "time_to_target_s": {"0.5": 240.0, "0.8": None}, "restarts": restarts,
            "resizes": 0, "preemption_checkpoints": 0, "lost_work": [], "comm_mode": "dense",
            "comm_bytes_per_worker": 8.0e7, "device_seconds": 160.0,
            "cost": {"device_hours": 0.0444, "node_hours": 0.0444, "usd": 0.0, "prices": {"local": 0.0}},
            "git_revision": "abc123", "versions": {"torch": "2.14.1"}, "command": "app/run.py --smoke-test",
            "config": cfg}))
    return run_dir


def red_columns(png: Path) -> list[int]:
    """x positions of vertical red (tab:red, restart) lines: clusters of columns with many red pixels."""
    img = Image.open(png).convert("RGB")
    w, h = img.size
    px = img.load()
    cols = []
    for x in range(w):
        n = sum(1 for y in range(h) if _is_red(px[x, y]))
        if n > h * 0.15:
            cols.append(x)
    clusters: list[int] = []
    for x in cols:
        if not clusters or x - clusters[-1] > 3:
            clusters.append(x)
        else:
            clusters[-1] = x
    return clusters


def _is_red(p: tuple[int, int, int]) -> bool:
    r, g, b = p
    return r > 180 and g < 130 and b < 130 and r - g > 90


# --- TensorBoard ------------------------------------------------------------------------------

def test_event_files_contain_the_named_scalars(tmp_path: Path) -> None:
    log_dir = tmp_path / "run" / "tensorboard"
    with TBLogger(str(log_dir)) as tb:
        for step in (5, 10):
            written = tb.scalars(train_line(step, T0 + step, restarts=1, val_top1=0.25, val_top5=0.5), step=step)
            assert "system/restarts" in written
    scalars = read_scalars(str(log_dir))
    expected = {"train/loss": 2.3 - 0.2, "val/top1": 0.25, "val/top5": 0.5, "schedule/lr": 0.4,
                "schedule/resolution": 32, "schedule/batch_size": 256, "system/images_per_s": 910.0,
                "system/data_wait_frac": 0.1, "system/comm_bytes": 1e7, "system/restarts": 1,
                "system/device_seconds": 20.0}
    for tag, value in expected.items():
        assert tag in scalars, f"missing tag {tag}; have {sorted(scalars)}"
        assert [s for s, _ in scalars[tag]] == [5, 10]
        assert scalars[tag][-1][1] == pytest.approx(value, rel=1e-6)
    # text and bookkeeping keys are not curves
    assert not any("comm_mode" in t or t.endswith("/time") or t.endswith("/step") for t in scalars)


def test_restarted_logger_purges_the_lost_attempts_steps(tmp_path: Path) -> None:
    log_dir = tmp_path / "tb"
    with TBLogger(str(log_dir)) as tb:
        for step in range(1, 6):
            tb.scalars({"loss": 10.0 + step}, step=step)
    # the checkpoint was at step 3: the second attempt redoes steps 3.. with other values
    with TBLogger(str(log_dir), purge_step=3) as tb:
        for step in range(3, 7):
            tb.scalars({"loss": 20.0 + step}, step=step)
    loss = read_scalars(str(log_dir))["train/loss"]
    assert loss == [(1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0), (5, 25.0), (6, 26.0)]


def test_read_scalars_names_a_folder_without_event_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no TensorBoard event files"):
        read_scalars(str(tmp_path))


def test_scalars_rejects_a_non_integer_step(tmp_path: Path) -> None:
    with TBLogger(str(tmp_path / "tb")) as tb, pytest.raises(TypeError, match="step"):
        tb.scalars({"loss": 1.0}, step=1.5)  # type: ignore[arg-type]


# --- run report -------------------------------------------------------------------------------

def test_report_renders_from_a_finished_run(tmp_path: Path) -> None:
    run = write_run(tmp_path / "demo-run")
    md_path = make_report(str(run))
    assert md_path == run / "report" / "report.md"
    md = md_path.read_text()
    assert "# lightray run: demo-run" in md
    assert "| final_top1 | 90.00% |" in md
    assert "| time_to_target_s.0.5 | 4m00s (240.0 s) |" in md
    assert "| time_to_target_s.0.8 | not reached |" in md
    assert "| train_images_per_s | 950.5 |" in md
    assert "| cost.usd | $0.00 |" in md and "| cost.device_hours | 0.044 h |" in md
    assert "progressive_resize" in md  # unit events are listed
    for png in ("accuracy.png", "throughput.png", "schedule.png"):
        assert f"]({png})" in md
        with Image.open(run / "report" / png) as img:
            assert img.format == "PNG" and img.size[0] > 500
    assert red_columns(run / "report" / "schedule.png") == []  # no restart, no restart line


def test_report_marks_each_restart_with_a_vertical_line(tmp_path: Path) -> None:
    run = write_run(tmp_path / "spot-run", restarts_at=(30, 60))
    md = make_report(str(run)).read_text()
    assert md.count("| restart |") == 2
    # one red line per restart across the panels' shared x position
    assert len(red_columns(run / "report" / "schedule.png")) == 2
    assert len(red_columns(run / "report" / "throughput.png")) == 2


def test_report_without_summary_uses_the_last_metrics(tmp_path: Path) -> None:
    run = write_run(tmp_path / "crashed", summary=False)
    md = make_report(str(run)).read_text()
    assert "summary.json is missing" in md
    assert "| val_top1 | 90.00% |" in md  # the last validation line, 0.1 + 80/100 capped at 0.95 -> 0.9


def test_report_of_a_run_stopped_before_its_first_report_says_so(tmp_path: Path) -> None:
    run = tmp_path / "early"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"event": "start", "time": T0, "samples_seen": 0}) + "\n")
    md = make_report(str(run)).read_text()
    assert "No training report in metrics.jsonl yet." in md
    assert "| start |" in md
    assert not list((run / "report").glob("*.png"))


def test_report_skips_a_truncated_last_line_but_names_a_bad_line_in_the_middle(tmp_path: Path) -> None:
    run = write_run(tmp_path / "torn")
    path = run / "metrics.jsonl"
    path.write_text(path.read_text() + '{"step": 85, "loss": 1.')
    assert "truncated last line" in make_report(str(run)).read_text()
    lines = path.read_text().splitlines()
    lines.insert(2, "not json")
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ReportError, match=r"metrics\.jsonl:3: not a JSON object"):
        make_report(str(run))


def test_the_report_command_on_a_missing_folder_prints_one_error_line_and_exits_2(tmp_path: Path, capsys) -> None:
    from lightray.cli import main

    missing = tmp_path / "no-such-run"
    assert main(["--report", str(missing)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err == [f"lightray: error: --report {missing}: no such folder; expected a run folder or a Tune "
                   "experiment folder"], err


def test_report_on_a_folder_without_metrics_says_what_it_expected(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match="no metrics.jsonl; expected a run folder"):
        make_report(str(tmp_path))
    with pytest.raises(ReportError, match="no such folder"):
        make_report(str(tmp_path / "nope"))


# --- experiment report ------------------------------------------------------------------------

def test_experiment_report_adds_the_trials_table_and_plot(tmp_path: Path) -> None:
    exp = tmp_path / "exp"
    write_run(exp / "trial_a1")
    write_run(exp / "trial_b2", restarts_at=(20,))
    trials = [
        {"trial_id": "a1", "params": {"optim": {"lr_per_256": 0.2}}, "metric": 0.61, "time_s": 50.0,
         "state": "TERMINATED"},
        {"trial_id": "b2", "params": {"optim": {"lr_per_256": 0.8}}, "metric": 0.74, "time_s": 61.5,
         "state": "TERMINATED"},
        {"trial_id": "c3", "params": {"optim": {"lr_per_256": 3.0}}, "metric": None, "time_s": 3.0,
         "state": "ERROR"},
    ]
    (exp / "trials.json").write_text(json.dumps(trials))
    md = make_report(str(exp)).read_text()
    assert "# lightray experiment: exp" in md
    assert "Best trial: **b2**" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| a1") or ln.startswith("| b2") or ln.startswith("| c3")]
    assert [r.split("|")[1].strip() for r in rows] == ["b2", "a1", "c3"]  # best first, unscored last
    assert "optim.lr_per_256" in md and "| 0.8 |" in md
    assert "trial c3: no run folder" in md
    assert (exp / "report" / "trials.png").is_file()
    assert (exp / "trial_b2" / "report" / "report.md").is_file()  # the best trial's own report
    assert "(../trial_b2/report/report.md)" in md


def test_experiment_report_names_a_malformed_trials_file(tmp_path: Path) -> None:
    (tmp_path / "trials.json").write_text(json.dumps({"trials": [{"params": {}}]}))
    with pytest.raises(ReportError, match=r"trials.json: trial \[0\]: expected an object with a trial_id"):
        make_report(str(tmp_path))


# --- summary table ----------------------------------------------------------------------------

def test_summary_table_formats_fractions_times_and_bytes() -> None:
    out = io.StringIO()
    print_summary_table({"run_name": "r1", "final_top1": 0.7612, "wall_time_s": 3725.0, "comm_bytes_per_worker": 2.5e9,
                         "time_to_target_s": {"0.5": 90.0, "0.8": None}, "train_images_per_s": 1234.5,
                         "config": {"a": 1}}, out)
    text = out.getvalue()
    assert "lightray run r1" in text
    assert re.search(r"^final_top1 +\| 76\.12%$", text, re.M)
    assert re.search(r"^wall_time_s +\| 1h02m \(3,725\.0 s\)$", text, re.M)
    assert re.search(r"^comm_bytes_per_worker +\| 2\.50 GB$", text, re.M)
    assert re.search(r"^time_to_target_s\.0\.5 +\| 1m30s", text, re.M)
    assert re.search(r"^time_to_target_s\.0\.8 +\| not reached$", text, re.M)
    assert re.search(r"^train_images_per_s +\| 1,234\.5$", text, re.M)
    assert "config" not in text  # the resolved config is saved beside the summary, not a table row


def test_the_quiet_table_keeps_the_headline_rows_and_names_the_file_with_the_rest() -> None:
    summary = {"run_name": "r1", "status": "finished", "final_top1": 0.5, "time_to_target_s": {"0.5": 9.0},
               "cost": {"usd": 1.5, "device_hours": 2.0}, "versions": {"torch": "2.14", "ray": "2.60"},
               "hardware": {"nodes": 1}, "git_revision": "abc", "run_dir": "/runs/r1"}
    quiet, full = io.StringIO(), io.StringIO()
    print_summary_table(summary, quiet, verbose=False)
    print_summary_table(summary, full)
    labels = [ln.split(" | ")[0].strip() for ln in quiet.getvalue().splitlines() if " | " in ln]
    assert labels == ["run_name", "status", "final_top1", "time_to_target_s.0.5", "cost.usd", "run_dir"]
    assert "summary.json" in quiet.getvalue().splitlines()[-1]
    assert "versions.torch" in full.getvalue() and "git_revision" in full.getvalue()


# --- MLflow -----------------------------------------------------------------------------------

def test_flatten_params_dots_nested_keys_and_indexes_lists_of_mappings() -> None:
    params = flatten_params(Config().to_dict())
    assert params["optim.lr_per_256"] == "0.4"
    assert params["schedule.phases.0.resolution"] == "64"
    assert params["report.targets"] == "[0.5, 0.8]"
    assert params["cost.price_per_hour.local"] == "0.0"
    assert all(isinstance(v, str) for v in params.values())
    assert flatten_params({"a": {}, "b": "x" * 900})["a"] == "{}"
    assert len(flatten_params({"b": "x" * 900})["b"]) == 500


def test_log_run_without_mlflow_names_the_package_to_install(tmp_path: Path, monkeypatch) -> None:
    # A None entry in sys.modules makes `import mlflow` fail as on a machine without the extra.
    monkeypatch.setitem(sys.modules, "mlflow", None)
    run = write_run(tmp_path / "r")
    with pytest.raises(MissingExtraError, match=r'pip install "mlflow-skinny>=2.10"'):
        log_run(f"sqlite:///{tmp_path / 'mlflow.db'}", str(run))


def test_log_run_copies_params_metric_history_summary_and_report_into_mlflow(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("mlflow", reason="mlflow-skinny is a declared dependency")
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root (./mlruns) lands here
    run = write_run(tmp_path / "r1", restarts_at=(25,))
    (run / "report").mkdir()
    (run / "report" / "report.md").write_text("# r1\n")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = log_run(uri, str(run), experiment="lr-test")

    client = MlflowClient(uri)
    logged = client.get_run(run_id)
    assert client.get_experiment(logged.info.experiment_id).name == "lr-test"
    assert logged.data.params["optim.lr_per_256"] == "0.4"
    assert logged.data.params["schedule.phases.0.resolution"] == "64"
    assert len(logged.data.params) == len(flatten_params(Config(name="r1").to_dict()))  # past one 100-param batch
    loss = client.get_metric_history(run_id, "train/loss")
    assert [m.step for m in loss] == list(range(5, 81, 5))
    assert [m.value for m in loss] == pytest.approx([2.3 - 0.02 * s for s in range(5, 81, 5)])
    assert [m.step for m in client.get_metric_history(run_id, "val/top1")] == list(range(10, 81, 10))
    assert logged.data.metrics["final/best_top1"] == pytest.approx(0.9)
    assert logged.data.metrics["final/restarts"] == 1
    artifacts = {a.path for a in client.list_artifacts(run_id)} | {
        a.path for a in client.list_artifacts(run_id, "report")}
    assert {"summary.json", "report/report.md"} <= artifacts


# --- a real run -------------------------------------------------------------------------------

def test_report_renders_from_a_real_smoke_run(finished_run: Path) -> None:
    run = finished_run
    scalars = read_scalars(str(run / "tensorboard"))
    assert {"train/loss", "schedule/lr", "system/images_per_s"} <= set(scalars)
    shutil.rmtree(run / "report", ignore_errors=True)  # the shared run may hold one from an earlier session
    out = subprocess.run([sys.executable, "app/run.py", "--report", str(run)], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    md = (run / "report" / "report.md").read_text()
    assert "## Summary" in md and (run / "report" / "schedule.png").is_file()
