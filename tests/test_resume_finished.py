"""A resume of a run that trained every planned sample answers from the run's summary, without Ray or a worker
group (app/driver/finished.py); a recipe that plans more sends it the usual way."""

import json
import shutil
import subprocess
import sys

from lightray.config import load_config
from lightray.driver.finished import already_finished
from tests.faults import ROOT
from tests.finished_run import finished_run_args


def _copy(finished_run, tmp_path):
    """A copy of the session's finished run: the shared one is only read."""
    storage = tmp_path / "runs"
    shutil.copytree(finished_run, storage / finished_run.name)
    return storage


def test_resume_of_a_finished_run_answers_from_its_summary_without_starting_ray(finished_run, tmp_path):
    storage = _copy(finished_run, tmp_path)
    run = storage / finished_run.name
    kept = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "summary.json", "resume.json")
            if (run / name).is_file()}
    # The finished run's own options, on "another machine": another shard cache, which changes nothing trained.
    out = subprocess.run([sys.executable, "app/run.py", "--smoke-test", "--resume", "--storage", str(storage),
                          "--name", finished_run.name, "--scaling.ray_address=local",
                          f"--data.cache_dir={tmp_path / 'other-cache'}", "--report.log_samples=true",
                          *finished_run_args(finished_run.parent.parent)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads(kept["summary.json"])
    assert f"already finished all {summary['samples_seen']} planned samples" in out.stdout, out.stdout[-2000:]
    assert "Ray not started" in out.stdout and "started a local Ray cluster" not in out.stdout
    # Nothing written: no restart in the records, the summary and the resume point as they were.
    assert {name: (run / name).read_bytes() for name in kept} == kept
    assert not (tmp_path / "other-cache").exists()  # not even a prepare


def test_a_recipe_that_plans_more_samples_is_not_finished(finished_run, tmp_path):
    storage = _copy(finished_run, tmp_path)
    run = storage / finished_run.name
    shared = finished_run.parent.parent
    base = {"storage": str(storage), "name": finished_run.name, "data.source": str(shared / "finished-run-photos"),
            "optim.ema_decay": "0.8", "report.targets": "[0.9]", "report.top5_targets": "[1.0]"}
    same = load_config("smoke", base)
    assert already_finished(same, str(run))["samples_seen"] == 512
    assert already_finished(load_config("smoke", {**base, "schedule.epochs": "3"}), str(run)) is None
    assert already_finished(load_config("smoke", {**base, "optim.lr_per_256": "0.3"}), str(run)) is None
    stopped = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**stopped, "status": "failed"}))
    assert already_finished(same, str(run)) is None
