"""Real searches on a small local Ray cluster: Optuna proposes, ASHA stops, trials are lightray runs on
the embedded demo (tiny budgets), the best recipe runs, and a killed driver resumes its experiment."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import optuna
import pytest
import ray
import yaml

from bench.common import kill_processes, process_tree
from lightray.config import load_config

REPO = pathlib.Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.own_cluster]

TINY_FIXED = {
    "scaling.workers": "1",
    "scaling.cpus_per_worker": 0.5,
    "data.limit_train": 128,
    "data.limit_val": 64,
    "report.tensorboard": False,
    "schedule.eval_resolution": 0,
    "global_batch": 32,
}


def write_space(path: pathlib.Path, **over) -> pathlib.Path:
    raw = {
        "metric": "val_loss",  # continuous, so ASHA's cut between trials never ties
        "trials": 4,
        "concurrent": 2,
        "budget": {"epochs": 2},
        "scheduler": {"name": "asha", "grace_period": 1, "reduction_factor": 4},
        "searcher": {"name": "tpe", "seed": 3, "n_startup_trials": 4},
        "fixed": dict(TINY_FIXED),
        # Orders of magnitude apart: the trials' losses after one epoch differ clearly.
        "params": {"optim.lr_per_256": {"dist": "loguniform", "low": 1e-4, "high": 2.0}},
    }
    raw.update(over)
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture()
def local_ray():
    # 6 logical CPUs: room for 2 trials plus the worker placement groups that trials stopped by ASHA can
    # leave behind while Ray's PlacementGroupCleaner has no State API (no dashboard here).
    if ray.is_initialized():  # another module's cluster (4 CPUs): this one needs its own
        ray.shutdown()
    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_search_runs_trials_stops_weak_ones_and_writes_a_runnable_best_recipe(tmp_path, local_ray, capsys):
    from lightray.driver.runner import run_training
    from lightray.tune.search import run_search

    space = write_space(tmp_path / "space.yaml")
    cfg = load_config("smoke", {"storage": str(tmp_path / "runs"), "name": "exp"})
    result = run_search(cfg, space=str(space))
    exp = pathlib.Path(result["experiment_dir"])
    assert exp == tmp_path / "runs" / "exp"

    trials = json.loads((exp / "trials.json").read_text())
    assert len(trials) == 4
    assert {"trial_id", "params", "metric", "time_s", "state", "run_dir"} <= set(trials[0])
    states = [t["state"] for t in trials]
    assert "EARLY_STOPPED" in states, trials  # ASHA cut at least one trial after epoch 1
    assert "COMPLETED" in states
    for t in trials:
        assert isinstance(t["metric"], float) and t["time_s"] > 0
        assert (pathlib.Path(t["run_dir"]) / "metrics.jsonl").is_file()  # each trial is a lightray run
        assert 1e-4 <= t["params"]["optim.lr_per_256"] <= 2.0
    best = min(trials, key=lambda t: t["metric"])
    assert result["best"]["trial_id"] == best["trial_id"]
    # ASHA compared at the rung in samples seen (epoch 1 of 2: 128 // 32 * 32 samples); stopped ones say so.
    assert result["rungs"]["samples"] == [128]
    for t in trials:
        assert t["stop_rung"] == 1 and t["samples_seen"] in (128, 256)
        assert (t["samples_seen"] == 128) == (t["state"] == "EARLY_STOPPED")
    # Each trial has a summary.json: its own when it finished by itself, else the search's, from its files.
    for t in trials:
        s = json.loads((pathlib.Path(t["run_dir"]) / "summary.json").read_text())
        assert s["samples_seen"] == t["samples_seen"] and s["epochs_planned"] == 2, (t, s)
        if t["state"] == "EARLY_STOPPED":
            assert s["status"] == "stopped" and s["stopped_by"]["tune_state"] == "EARLY_STOPPED", s
            assert s["stopped_by"]["stop_rung"] == 1 and s["best_top1"] is not None, s
    # Every trial's start-up is broken down to its first step, and the data work was shared. One-worker
    # trials train in their own Tune process (trial_runner auto -> inline): no worker group to start.
    for t in trials:
        ph = t["startup"]["phases_s"]
        assert t["startup"]["shared"] and t["startup"]["first_step_s"] > 0
        assert t["startup"]["runner"] == "inline"
        assert {"inline_start", "first_batch", "materialisation", "data_prepare"} <= set(ph)
        assert "worker_group_start" not in ph
        events = [json.loads(line) for line in (pathlib.Path(t["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        cache = [e for e in events if e.get("unit") == "data_cache" and e.get("served")]
        assert cache and all(e.get("shared") for e in cache), cache
    assert result["startup"]["trials"] == 4
    assert (exp / "report" / "parallel_coordinates.png").is_file() and (exp / "report" / "search.md").is_file()
    # Stopped and finished trials have let go of their CPUs: the cluster is whole again.
    total = ray.cluster_resources()["CPU"]
    deadline = time.time() + 60
    while ray.available_resources().get("CPU", 0) < total - 1e-6:
        assert time.time() < deadline, (ray.available_resources(), total)
        time.sleep(1)

    study = optuna.load_study(study_name="exp", storage=f"sqlite:///{exp / 'optuna.db'}")
    assert len(study.trials) == 4 and study.direction == optuna.study.StudyDirection.MINIMIZE
    assert (exp / "search.png").stat().st_size > 0
    assert (exp / "report" / "report.md").is_file()
    out = capsys.readouterr().out
    assert best["trial_id"] in out and "EARLY_STOPPED" in out

    recipe = pathlib.Path(result["best_recipe"])
    rec_cfg = load_config(str(recipe), {"storage": str(tmp_path / "runs"), "name": "best-rerun"})
    assert rec_cfg.optim.lr_per_256 == pytest.approx(best["params"]["optim.lr_per_256"])
    assert rec_cfg.scaling.workers == "1" and rec_cfg.schedule.epochs == 2
    summary = run_training(rec_cfg, progress=False)
    assert (tmp_path / "runs" / "best-rerun" / "summary.json").is_file()
    assert summary.get("error") in (None, "")


DRIVER = """
import sys, ray
ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
from lightray.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _terminated_in_state(exp: pathlib.Path) -> int:
    """Trials Tune has saved as finished in its experiment state (what a restore will keep)."""
    n = 0
    for f in exp.glob("experiment_state-*.json"):
        try:
            n = max(n, f.read_text().count("TERMINATED"))
        except OSError:
            pass
    return n


def test_killed_driver_resumes_with_finished_trials_kept(tmp_path):
    # Trials as Ray Train worker groups (the runner multi-worker trials use), the other runner's path.
    space = write_space(tmp_path / "space.yaml", trials=2, concurrent=1, scheduler={"name": "fifo"},
                        budget={"epochs": 2}, trial_runner="train")
    storage = tmp_path / "runs"
    args = ["--config", "smoke", "--tune", "--space", str(space), "--storage", str(storage), "--name", "exp"]
    env = dict(os.environ, TUNE_GLOBAL_CHECKPOINT_S="1", PYTHONPATH=str(REPO))
    log = open(tmp_path / "first.log", "w")
    drv = subprocess.Popen([sys.executable, "-c", DRIVER, *args], cwd=REPO, env=env, stdout=log,
                           stderr=subprocess.STDOUT)
    exp = storage / "exp"
    try:
        deadline = time.time() + 900
        while _terminated_in_state(exp) < 1:
            assert drv.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.time() < deadline, "no trial finished in time"
            time.sleep(1)
    finally:
        family = process_tree(drv.pid)
        drv.send_signal(signal.SIGKILL)  # the driver dies without any cleanup
        drv.wait()
        kill_processes(family)  # and so does the local cluster it had started
        log.close()
    assert not (exp / "trials.json").exists()
    finished = [p.parent for p in exp.glob("*/summary.json")]
    assert len(finished) == 1
    done_id = finished[0].name
    done_summary = (finished[0] / "summary.json").read_bytes()
    starts_before = (finished[0] / "metrics.jsonl").read_text().count('"event": "start"')

    res = subprocess.run([sys.executable, "-c", DRIVER, *args, "--resume"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    trials = json.loads((exp / "trials.json").read_text())
    assert len(trials) == 2
    by_id = {t["trial_id"]: t for t in trials}
    assert by_id[done_id]["state"] == "COMPLETED"
    assert all(t["state"] == "COMPLETED" for t in trials), trials
    # The finished trial was not run again: same summary, no new start in its metrics.
    assert (finished[0] / "summary.json").read_bytes() == done_summary
    assert (finished[0] / "metrics.jsonl").read_text().count('"event": "start"') == starts_before
    assert (exp / "best_recipe.yaml").is_file()
    assert all(t["startup"]["runner"] == "train" and "worker_group_start" in t["startup"]["phases_s"]
               for t in trials if t["startup"]), trials


def test_ended_trial_placement_groups_recorded_by_the_run_are_freed(tmp_path, local_ray):
    from ray.util.placement_group import placement_group, placement_group_table

    from lightray.tune.free import PG_FILE, free_placement_groups

    pg = placement_group([{"CPU": 1.0}, {"CPU": 1.0}])
    ray.get(pg.ready(), timeout=60)
    assert ray.available_resources()["CPU"] == pytest.approx(4.0)
    run = tmp_path / "trial"
    run.mkdir()
    (run / PG_FILE).write_text(json.dumps([pg.id.hex()]))
    assert free_placement_groups(str(run)) == 1
    assert placement_group_table(pg)["state"] == "REMOVED"
    deadline = time.time() + 30
    while ray.available_resources().get("CPU", 0) < 6.0:
        assert time.time() < deadline, ray.available_resources()
        time.sleep(0.5)
    assert free_placement_groups(str(run)) == 0  # already gone: nothing to do
    assert free_placement_groups(str(tmp_path / "no-such-trial")) == 0
