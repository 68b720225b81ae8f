"""Reading a search without Ray: the report of an experiment folder (Optuna importances from a real study,
the parallel-coordinates plot, the trial table with stop rungs), the per-trial start-up breakdown, and the
trial-seconds accounting of bench.search's fair comparison."""

from __future__ import annotations

import json
import pathlib

import optuna
import pytest
import yaml

from bench.search import _median_censored, best_at, compare, curve, trial_s_to_reach
from lightray.config import load_config
from lightray.tune.report import trial_table, write_search_report
from lightray.tune.space import parse_space
from lightray.tune.trial_startup import TRIAL_START_FILE, summarize, trial_startup

SPACE = {"metric": "val_top1", "trials": 12, "scheduler": {"name": "asha"}, "budget": {"epochs": 2},
         "params": {"optim.lr_per_256": {"dist": "loguniform", "low": 0.01, "high": 4.0},
                    "optim.label_smoothing": {"dist": "choice", "values": [0.0, 0.1]},
                    "optim.weight_decay": {"dist": "uniform", "low": 0.0, "high": 1e-3}}}


def make_experiment(tmp_path: pathlib.Path) -> pathlib.Path:
    """An experiment folder as a search leaves it: the space, the base config, trials.json, the study.
    The metric depends on the LR only (peaked at lr 0.5), so the LR must come out as the important one."""
    exp = tmp_path / "exp"
    exp.mkdir()
    base = load_config("demo")
    sp = parse_space(SPACE, base, "space")
    (exp / "base_config.yaml").write_text(yaml.safe_dump(base.to_dict(), sort_keys=False))
    (exp / "tune_space.yaml").write_text(yaml.safe_dump(sp.to_dict(), sort_keys=False))
    study = optuna.create_study(study_name="exp", storage=f"sqlite:///{exp / 'optuna.db'}", direction="maximize",
                                sampler=optuna.samplers.RandomSampler(seed=0))
    records = []
    for i in range(12):
        t = study.ask(sp.optuna_space())
        import math

        value = 0.8 - 0.15 * abs(math.log(t.params["optim.lr_per_256"] / 0.5))
        study.tell(t, value)
        stopped = value < 0.5
        records.append({"trial_id": f"t{i:02d}", "params": t.params, "metric": value, "time_s": 10.0 + i,
                        "state": "EARLY_STOPPED" if stopped else "COMPLETED", "epochs": 1 if stopped else 2,
                        "samples_seen": 960 if stopped else 1920, "stop_rung": 1,
                        "startup": {"first_step_s": 20.0 + i, "phases_s": {}, "shared": True}})
    (exp / "trials.json").write_text(json.dumps(records))
    return exp


def test_search_report_writes_importances_parallel_plot_and_trial_table_with_stop_rungs(tmp_path):
    exp = make_experiment(tmp_path)
    paths = write_search_report(exp)
    imp = json.loads(pathlib.Path(paths["importances"]).read_text())
    assert set(imp) == {"optim.lr_per_256", "optim.label_smoothing", "optim.weight_decay"}
    assert max(imp, key=imp.get) == "optim.lr_per_256"  # the only parameter the metric depends on
    png = pathlib.Path(paths["parallel_coordinates"]).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    md = pathlib.Path(paths["markdown"]).read_text()
    assert "stop_rung" in md and "optim.lr_per_256" in md and "parallel_coordinates.png" in md
    rows = [line for line in md.splitlines() if line.startswith("| t") and not line.startswith("| trial")]
    assert len(rows) == 12
    stopped = [r for r in rows if "EARLY_STOPPED" in r]
    assert stopped and all("| 1 | EARLY_STOPPED |" in r for r in stopped)


def test_cli_report_on_a_tune_experiment_adds_the_search_report(tmp_path, capsys):
    from lightray.cli import main

    exp = make_experiment(tmp_path)
    assert main(["--report", str(exp)]) == 0
    out = capsys.readouterr().out
    assert str(exp / "report" / "parallel_coordinates.png") in out
    assert (exp / "report" / "search.md").is_file() and (exp / "report" / "importances.json").is_file()


def test_trial_table_marks_only_stopped_trials_with_their_rung():
    sp = parse_space(SPACE, load_config("demo"), "space")
    recs = [{"trial_id": "a", "params": {"optim.lr_per_256": 0.1}, "metric": 0.3, "time_s": 5.0, "epochs": 1,
             "samples_seen": 960, "stop_rung": 1, "state": "EARLY_STOPPED"},
            {"trial_id": "b", "params": {"optim.lr_per_256": 0.5}, "metric": 0.6, "time_s": 9.0, "epochs": 2,
             "samples_seen": 1920, "stop_rung": 1, "state": "COMPLETED"}]
    lines = trial_table(sp, recs).splitlines()
    assert "| 1 | EARLY_STOPPED |" in lines[2] and "| - | COMPLETED |" in lines[3]


def test_trial_startup_breakdown_runs_from_the_trial_start_to_its_first_step(tmp_path):
    run = tmp_path / "t1"
    run.mkdir()
    t0 = 1000.0
    (run / TRIAL_START_FILE).write_text(json.dumps({"start": t0, "shared": True}))
    (run / "startup.json").write_text(json.dumps({"process_start": 900.0, "phases": [
        {"phase": "ray_start", "start": t0 + 2, "end": t0 + 2.1},
        {"phase": "data_prepare", "start": t0 + 2.1, "end": t0 + 2.5},
        {"phase": "materialisation", "start": t0 + 3, "end": t0 + 3.2},
        {"phase": "trainer_setup", "start": t0 + 3.2, "end": t0 + 4}]}))
    (run / "metrics.jsonl").write_text(json.dumps({"event": "start", "time": t0 + 20}) + "\n"
                                       + json.dumps({"event": "first_step", "time": t0 + 23}) + "\n")
    got = trial_startup(str(run))
    assert got["first_step_s"] == 23.0 and got["shared"] is True
    ph = got["phases_s"]
    assert ph["trial_setup"] == 2.0 and ph["worker_group_start"] == 16.0 and ph["first_batch"] == 3.0
    summary = summarize([{"startup": got}, {"startup": None}, {"startup": dict(got, first_step_s=43.0)}])
    assert summary["trials"] == 2 and summary["first_step_s_median"] == 33.0
    assert summary["first_step_s_min_max"] == [23.0, 43.0]
    assert trial_startup(str(tmp_path / "missing")) is None


# --- bench.search's accounting ------------------------------------------------------------------------------
def test_curve_counts_trial_seconds_of_side_by_side_trials_at_each_finish():
    trials = [{"start": 0.0, "time_s": 10.0, "metric": 0.2},
              {"start": 0.0, "time_s": 30.0, "metric": 0.5},
              {"start": 10.0, "time_s": 10.0, "metric": 0.3},
              {"start": 20.0, "time_s": 5.0, "metric": None}]
    pts = curve(trials)
    # t=10: 10 + 10 ; t=20: 10 + 20 + 10 ; t=25: 10 + 25 + 10 + 5 ; t=30: 10 + 30 + 10 + 5
    assert pts == [(20.0, 0.2), (40.0, 0.3), (50.0, 0.3), (55.0, 0.5)]
    assert best_at(pts, 45.0) == 0.3 and best_at(pts, 10.0) is None
    assert trial_s_to_reach(pts, 0.3) == 40.0 and trial_s_to_reach(pts, 0.9) is None


def test_censored_median_treats_never_reached_as_slowest():
    assert _median_censored([10.0, 30.0, None]) == 30.0
    assert _median_censored([10.0, None, None]) is None
    assert _median_censored([10.0, 20.0]) == 15.0


def test_compare_reports_spread_and_the_trial_second_ratio_to_random_median_best():
    def search(*finishes):  # sequential trials: (duration, metric)
        out, t = [], 0.0
        for d, m in finishes:
            out.append({"start": t, "time_s": d, "metric": m})
            t += d
        return out

    runs = {"random": [search((50, 0.3), (50, 0.4)), search((50, 0.2), (50, 0.5)), search((50, 0.4), (50, 0.41))],
            "tpe_asha": [search((25, 0.45)), search((20, 0.3), (20, 0.42)), search((100, 0.1))]}
    figures, ratios = compare(runs, budget_s=100.0)
    assert figures["random_median_best_top1"] == 0.41
    assert figures["best_top1_at_budget"]["random"]["runs"] == [0.4, 0.5, 0.41]
    assert figures["best_top1_at_budget"]["tpe_asha"]["n"] == 3
    # random reaches 0.41 at 100, 100, 100; TPE at 25, 40, never -> median 40
    assert figures["median_trial_s_to_random_median_best"] == {"random": 100.0, "tpe_asha": 40.0}
    assert ratios["random_over_tpe_asha_trial_s_to_same_best"] == 2.5
    assert ratios["random_over_tpe_asha_trial_s_to_same_best_min_max"] == [2.5, 4.0]
    # TPE never getting there in most seeds gives no ratio, and says why
    runs["tpe_asha"] = [search((100, 0.1)), search((100, 0.2)), search((25, 0.45))]
    figures, ratios = compare(runs, budget_s=100.0)
    assert ratios["random_over_tpe_asha_trial_s_to_same_best"] is None and "did not reach" in figures["ratio_note"]


@pytest.mark.parametrize("budget", [0.0])
def test_compare_with_nothing_finished_in_budget_says_so(budget):
    figures, ratios = compare({"random": [[{"start": 0, "time_s": 10, "metric": 0.3}]], "tpe_asha": []}, budget)
    assert ratios["random_over_tpe_asha_trial_s_to_same_best"] is None and "no random search" in figures["note"]
