"""Search-space files: parsing, every bad-input case (exit status 2 naming the entry), budget and batch
mapping, the time-to-target objective and trial sizing. No Ray cluster needed."""

from __future__ import annotations

import pathlib

import pytest
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from lightray.config import ConfigError, load_config
from lightray.tune.objective import Objective
from lightray.tune.search import fit_concurrency, format_table, trial_bundles
from lightray.tune.space import (
    SPACES_DIR,
    apply_params,
    base_for_trials,
    load_space,
    parse_space,
    trial_runner,
)

BASE = {"params": {"optim.lr_per_256": {"dist": "loguniform", "low": 0.01, "high": 1.0}}}


@pytest.fixture(scope="module")
def demo_cfg():
    # Pinned phases (the shape of an earlier demo recipe) so these tests do not move with the recipe.
    return load_config("demo", {"schedule.epochs": 10, "schedule.phases": (
        "[{until_epoch: 4, resolution: 32, batch_size: 256}, {until_epoch: 8, resolution: 48, batch_size: 192},"
        " {until_epoch: 10, resolution: 64, batch_size: 128}]")})


def space(**over):
    raw = yaml.safe_load(yaml.safe_dump(BASE))
    for k, v in over.items():
        raw[k] = v
    return raw


def param(key, spec):
    return space(params={key: spec})


def test_shipped_spaces_parse_into_optuna_distributions(demo_cfg):
    demo = load_space(str(SPACES_DIR / "demo.yaml"), demo_cfg)
    dists = demo.optuna_space()
    assert isinstance(dists["optim.lr_per_256"], FloatDistribution) and dists["optim.lr_per_256"].log
    assert isinstance(dists["schedule.warmup_epochs"], FloatDistribution) and not dists["schedule.warmup_epochs"].log
    assert isinstance(dists["optim.label_smoothing"], CategoricalDistribution)
    assert demo.fixed["scaling.workers"] == "1" and demo.budget_epochs == 3 and demo.scheduler == "asha"
    large = load_space("large_batch", demo_cfg)
    assert {p.key for p in large.params} >= {"optim.lr_per_256", "schedule.warmup_epochs", "global_batch",
                                             "comm.ratio", "optim.label_smoothing", "optim.weight_decay",
                                             "optim.trust_coefficient"}
    # The compression ratio is searched together with whether (and how) to compress at all.
    assert large.fixed["optim.name"] == "lars"
    modes = next(p for p in large.params if p.key == "comm.mode")
    assert {"dense", "topk"} <= set(modes.values)
    assert large.objective == "time_to_target" and "lr_rule" in {p.key for p in large.params}


def test_space_round_trips_through_its_saved_form(demo_cfg):
    sp = load_space("large_batch", demo_cfg)
    again = parse_space(yaml.safe_load(yaml.safe_dump(sp.to_dict())), demo_cfg, "saved")
    assert again.to_dict() == sp.to_dict()


def test_int_key_gets_int_distribution_with_log_scale(demo_cfg):
    sp = parse_space(param("comm.warmup_steps", {"dist": "int", "low": 1, "high": 64, "log": True}), demo_cfg)
    d = sp.optuna_space()["comm.warmup_steps"]
    assert isinstance(d, IntDistribution) and d.log and (d.low, d.high) == (1, 64)


@pytest.mark.parametrize("raw, words", [
    (param("optim.lr_per_257", {"dist": "uniform", "low": 0.1, "high": 1}), ["params.optim.lr_per_257",
                                                                              "unknown config key"]),
    (param("optimizer.lr", {"dist": "uniform", "low": 0.1, "high": 1}), ["params.optimizer.lr", "unknown"]),
    (param("lr", {"dist": "uniform", "low": 0.1, "high": 1}), ["params.lr", "unknown config key"]),
    (param("optim.lr_per_256", {"dist": "uniform", "low": 1.0, "high": 0.1}), ["params.optim.lr_per_256",
                                                                                "inverted bounds"]),
    (param("optim.lr_per_256", {"dist": "uniform", "low": 0.5, "high": 0.5}), ["inverted bounds"]),
    (param("schedule.epochs", {"dist": "uniform", "low": 1, "high": 4}), ["params.schedule.epochs",
                                                                          "does not fit integer key"]),
    (param("optim.name", {"dist": "loguniform", "low": 1, "high": 4}), ["params.optim.name", "use dist: choice"]),
    (param("schedule.phases", {"dist": "choice", "values": [1, 2]}), ["params.schedule.phases", "type"]),
    (param("comm.ratio", {"dist": "choice", "values": ["a lot"]}), ["params.comm.ratio.values[0]", "number"]),
    (param("optim.nesterov", {"dist": "choice", "values": ["maybe"]}), ["params.optim.nesterov.values[0]",
                                                                        "true or false"]),
    (param("schedule.epochs", {"dist": "int", "low": 1.5, "high": 4}), ["params.schedule.epochs.low",
                                                                        "integer"]),
    (param("optim.lr_per_256", {"dist": "loguniform", "low": 0.0, "high": 1}), ["params.optim.lr_per_256.low",
                                                                                 "log scale"]),
    (param("optim.lr_per_256", {"dist": "normal", "low": 0.1, "high": 1}), ["params.optim.lr_per_256.dist",
                                                                             "loguniform"]),
    (param("optim.lr_per_256", {"dist": "uniform", "low": 0.1}), ["params.optim.lr_per_256.high", "missing"]),
    (param("optim.lr_per_256", {"dist": "uniform", "lo": 0.1, "high": 1}), ["params.optim.lr_per_256.lo",
                                                                             "unknown key"]),
    (param("optim.lr_per_256", 0.4), ["params.optim.lr_per_256", "expected a mapping"]),
    (param("optim.momentum", {"dist": "uniform", "low": 0.5, "high": 1.5}), ["params.optim.momentum = 1.5",
                                                                              "optim.momentum"]),
    (param("comm.mode", {"dist": "choice", "values": ["dense", "gzip"]}), ["params.comm.mode = 'gzip'",
                                                                           "allowed"]),
    (param("optim.label_smoothing", {"dist": "choice", "values": []}), ["values", "non-empty"]),
    (space(params={}), ["params", "expected a mapping"]),
    (space(objective="fastest"), ["objective", "max_metric"]),
    (space(mode="up"), ["mode", "max, min"]),
    (space(metric="loss"), ["metric", "validation metric"]),
    (space(trials=0), ["trials", ">= 1"]),
    (space(budget={"epochs": 0}), ["budget.epochs"]),
    (space(budget={"hours": 1}), ["budget.hours", "unknown key"]),
    (space(scheduler={"name": "hyperband"}), ["scheduler.name", "asha"]),
    (space(scheduler={"grace_period": 9}, budget={"epochs": 2}), ["scheduler.grace_period", "budget"]),
    (space(scheduler={"reduction_factor": 1}), ["scheduler.reduction_factor", "> 1"]),
    (space(searcher={"name": "cmaes"}), ["searcher.name", "tpe"]),
    (space(fixed={"optim.lr": 1}), ["fixed.optim.lr", "unknown config key"]),
    (space(fixed={"optim.lr_per_256": 0.1}), ["params.optim.lr_per_256", "also set in fixed"]),
    (space(fixed={"optim.momentum": 3}), ["fixed/budget", "optim.momentum"]),
    (space(objective="time_to_target", target=1.5), ["target", "(0, 1]"]),
    (space(surprise=1), ["surprise", "unknown key"]),
])
def test_bad_space_entry_raises_config_error_naming_it(demo_cfg, raw, words):
    with pytest.raises(ConfigError) as err:
        parse_space(raw, demo_cfg, "my_space.yaml")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("my_space.yaml")
    for w in words:
        assert w in msg, (w, msg)


def test_cli_tune_with_bad_space_exits_2_with_one_line(tmp_path, capsys):
    from lightray.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(param("optim.lr_per_256", {"dist": "uniform", "low": 2.0, "high": 1.0})))
    assert main(["--tune", "--space", str(bad), "--storage", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "params.optim.lr_per_256" in err[0] and "inverted bounds" in err[0]
    assert main(["--tune", "--space", str(tmp_path / "nope.yaml"), "--storage", str(tmp_path / "runs")]) == 2
    assert "nope.yaml" in capsys.readouterr().err
    assert main(["--tune", "--resume", "--storage", str(tmp_path / "empty")]) == 2
    assert "no tune experiment" in capsys.readouterr().err


def test_budget_cuts_or_stretches_phases_and_warmup(demo_cfg):
    # demo phases end at epochs 4, 8, 10; a 5-epoch budget keeps two phases, the second cut to end at 5.
    cut = base_for_trials(demo_cfg, parse_space(space(budget={"epochs": 5}), demo_cfg))
    assert cut.schedule.epochs == 5
    assert [(p.until_epoch, p.resolution) for p in cut.schedule.phases] == [(4, 32), (5, 48)]
    long = base_for_trials(demo_cfg, parse_space(space(budget={"epochs": 14}), demo_cfg))
    assert [p.until_epoch for p in long.schedule.phases] == [4, 8, 14]
    short_cfg = load_config("demo", {"schedule.warmup_epochs": 3, "schedule.phases": "[{until_epoch: 16, resolution: "
                                     "32, batch_size: 128}]"})
    short = base_for_trials(short_cfg, parse_space(space(budget={"epochs": 2}), short_cfg))
    assert short.schedule.warmup_epochs == 2 and len(short.schedule.phases) == 1


def test_global_batch_scales_every_phase_by_one_factor(demo_cfg):
    cfg = apply_params(demo_cfg, {"global_batch": 512, "optim.lr_per_256": 0.8})
    assert [p.batch_size for p in cfg.schedule.phases] == [512, 384, 256]  # demo: 256, 192, 128
    assert cfg.optim.lr_per_256 == 0.8
    sp = parse_space(param("global_batch", {"dist": "choice", "values": [64, 128]}), demo_cfg)
    assert sp.optuna_space()["global_batch"].choices == (64, 128)
    with pytest.raises(ConfigError, match="params.global_batch"):
        parse_space(param("global_batch", {"dist": "uniform", "low": 64, "high": 128}), demo_cfg, "s")


def test_default_mode_follows_metric(demo_cfg):
    assert parse_space(space(metric="val_loss"), demo_cfg).mode == "min"
    assert parse_space(space(metric="val_top5"), demo_cfg).mode == "max"
    ttt = parse_space(space(objective="time_to_target", target=0.6), demo_cfg)
    assert (ttt.tune_metric, ttt.tune_mode) == ("time_to_target_s", "min")


def test_time_to_target_projects_until_reached_then_holds():
    obj = Objective("time_to_target", "val_top1", target=0.5)
    first = obj.augment({"val_top1": 0.25, "elapsed_s": 10.0, "epoch": 1})
    assert first["time_to_target_s"] == pytest.approx(20.0) and first["reached_target"] == 0
    hit = obj.augment({"val_top1": 0.55, "elapsed_s": 30.0, "epoch": 2})
    assert hit["time_to_target_s"] == 30.0 and hit["reached_target"] == 1
    later = obj.augment({"val_top1": 0.45, "elapsed_s": 50.0, "epoch": 3})
    assert later["time_to_target_s"] == 30.0  # the first time it got there counts
    plain = Objective("max_metric", "val_top1", 0.5)
    assert plain.augment({"val_top1": 0.3, "epoch": 1}) == {"val_top1": 0.3, "epoch": 1}
    assert not plain.wants({"loss": 1.0, "epoch": 0})  # interval checkpoints carry no validation


def test_concurrency_is_cut_to_what_the_cluster_holds():
    cfg = load_config("demo", {"scaling.workers": "1", "scaling.cpus_per_worker": 0.5})
    assert fit_concurrency(cfg, 2, {"CPU": 4.0}) == (2, "")
    k, note = fit_concurrency(cfg, 8, {"CPU": 4.0})
    assert k == 2 and "--concurrent 8" in note
    with pytest.raises(ConfigError, match="--concurrent"):
        fit_concurrency(load_config("demo", {"scaling.workers": "8"}), 1, {"CPU": 2.0})
    gpu = load_config("demo", {"scaling.workers": "2", "scaling.use_gpu": "true"})
    assert fit_concurrency(gpu, 4, {"CPU": 64.0, "GPU": 4.0})[0] == 2


def test_trial_table_lists_params_metric_time_and_state(demo_cfg):
    sp = parse_space(BASE, demo_cfg)
    rows = [{"trial_id": "a_00000", "params": {"optim.lr_per_256": 0.5}, "metric": 0.41, "time_s": 12.5,
             "state": "COMPLETED", "epochs": 3},
            {"trial_id": "a_00001", "params": {"optim.lr_per_256": 0.01}, "metric": 0.12, "time_s": 4.0,
             "state": "EARLY_STOPPED", "epochs": 1}]
    table = format_table(rows, sp).splitlines()
    assert "optim.lr_per_256" in table[0] and "val_top1" in table[0] and "state" in table[0]
    assert "EARLY_STOPPED" in table[3] and "0.12" in table[3]


def test_space_path_by_bare_name_and_missing_file(demo_cfg, tmp_path):
    assert load_space("demo", demo_cfg).source.endswith("tune_spaces/demo.yaml")
    with pytest.raises(ConfigError, match="--space"):
        load_space(str(tmp_path / "missing.yaml"), demo_cfg)
    broken = tmp_path / "broken.yaml"
    broken.write_text("params: [unclosed")
    with pytest.raises(ConfigError, match="broken.yaml"):
        load_space(str(broken), demo_cfg)
    assert pathlib.Path(SPACES_DIR / "large_batch.yaml").is_file()


# --- rungs, LR rule, shared start-up switch, experiment budget ---------------------------------------------
def test_asha_rungs_sit_at_phase_boundaries_after_the_longest_warmup(demo_cfg):
    from lightray.tune.rungs import grace_epochs, rung_epochs, rung_milestones

    # demo_cfg phases end at 4, 8, 10; a 10-epoch budget keeps them; warm-up searched up to 3 epochs.
    sp = parse_space(space(budget={"epochs": 10}, scheduler={"name": "asha", "reduction_factor": 2},
                           params={"schedule.warmup_epochs": {"dist": "uniform", "low": 0.5, "high": 3.0}}),
                     demo_cfg)
    tb = base_for_trials(demo_cfg, sp)
    assert grace_epochs(tb, sp) == 3
    assert rung_epochs(tb, sp) == [4, 8]
    # A longer possible warm-up moves the first rung past the first boundary.
    late = parse_space(space(budget={"epochs": 10}, params={"schedule.warmup_epochs": {
        "dist": "uniform", "low": 0.5, "high": 4.5}}), demo_cfg)
    assert rung_epochs(base_for_trials(demo_cfg, late), late) == [8]
    # In samples seen: epoch 4 starts after 4 * (1000 // 256) * 256 samples at the first phase's batch.
    rungs = rung_milestones(tb, sp, 1000)
    assert rungs["epochs"] == [4, 8] and rungs["samples"] == [4 * 3 * 256, 4 * 3 * 256 + 4 * 5 * 192]


def test_rungs_in_samples_use_the_largest_searched_batch_so_every_trial_reaches_them(demo_cfg):
    from lightray.tune.rungs import rung_milestones

    sp = parse_space(space(budget={"epochs": 10}, params={"global_batch": {"dist": "choice", "values": [128, 512]}}),
                     demo_cfg)
    tb = base_for_trials(demo_cfg, sp)
    rungs = rung_milestones(tb, sp, 1000)
    # batch 512 in phase 0: 1 step of 512 per epoch (the 488 left over are dropped) -> 4 * 512 at epoch 4
    assert rungs["samples"][0] == 4 * 512
    # and ASHA's max_t is the most any trial can see (the small batch: 7 steps of 128 per epoch in phase 0)
    assert rungs["max_samples"] > rungs["samples"][-1]


def test_single_phase_schedule_gets_geometric_rungs_from_the_grace_period(demo_cfg):
    from lightray.tune.rungs import rung_epochs

    one = {"fixed": {"schedule.phases": [{"until": 1.0, "resolution": 32, "batch_size": 128}]},
           "budget": {"epochs": 9}, "scheduler": {"name": "asha", "reduction_factor": 2, "grace_period": 0}}
    sp = parse_space(space(**one), demo_cfg)
    assert rung_epochs(base_for_trials(demo_cfg, sp), sp) == [1, 2, 4, 8]
    one["scheduler"]["grace_period"] = 3  # given explicitly: it wins over the recipe's warm-up
    sp = parse_space(space(**one), demo_cfg)
    assert rung_epochs(base_for_trials(demo_cfg, sp), sp) == [3, 6]


def test_asha_with_sample_rungs_stops_the_weaker_trial_at_the_first_rung(demo_cfg):
    from ray.tune.schedulers import TrialScheduler

    from lightray.tune.rungs import make_asha

    sp = parse_space(space(budget={"epochs": 10}), demo_cfg)
    asha = make_asha(sp, {"epochs": [4, 8], "samples": [3000, 6000], "max_samples": 8000})
    assert [m for m, _ in asha._brackets[0]._rungs] == [6000, 3000]

    class T:  # Tune's trial only needs an id here
        def __init__(self, tid):
            self.trial_id = tid

    good, bad = T("a"), T("b")
    for t in (good, bad):
        asha.on_trial_add(None, t)
    assert asha.on_trial_result(None, good, {"samples_seen": 1000, "val_top1": 0.1}) == TrialScheduler.CONTINUE
    assert asha.on_trial_result(None, good, {"samples_seen": 3072, "val_top1": 0.5}) == TrialScheduler.CONTINUE
    assert asha.on_trial_result(None, bad, {"samples_seen": 3072, "val_top1": 0.2}) == TrialScheduler.STOP


def test_lr_rule_sqrt_scales_lr_by_the_root_of_the_batch(demo_cfg):
    sp = parse_space(space(params={"global_batch": {"dist": "choice", "values": [256, 1024]},
                                   "lr_rule": {"dist": "choice", "values": ["linear", "sqrt"]}}), demo_cfg)
    tb = base_for_trials(demo_cfg, sp)
    lin = apply_params(tb, {"global_batch": 1024, "lr_rule": "linear", "optim.lr_per_256": 0.4})
    sq = apply_params(tb, {"global_batch": 1024, "lr_rule": "sqrt", "optim.lr_per_256": 0.4})
    assert lin.optim.lr_per_256 == pytest.approx(0.4)
    # peak LR: linear 0.4 * 1024/256 = 1.6; sqrt 0.4 * sqrt(1024/256) = 0.8
    assert sq.optim.lr_per_256 * 1024 / 256 == pytest.approx(0.8)
    with pytest.raises(ConfigError, match="lr_rule"):
        parse_space(space(params={"lr_rule": {"dist": "choice", "values": ["cubic"]}}), demo_cfg)
    with pytest.raises(ConfigError, match="fixed.lr_rule"):
        parse_space(space(fixed={"lr_rule": "sqrt"}), demo_cfg)


def test_share_startup_switch_and_total_time_budget_parse_and_round_trip(demo_cfg):
    sp = parse_space(space(), demo_cfg)
    assert sp.share_startup is True and sp.budget_total_s == 0.0 and sp.grace_period == 0
    off = parse_space(space(share_startup=False, budget={"epochs": 2, "total_time_s": 120}), demo_cfg)
    assert off.share_startup is False and off.budget_total_s == 120.0
    again = parse_space(yaml.safe_load(yaml.safe_dump(off.to_dict())), demo_cfg, "saved")
    assert again.to_dict() == off.to_dict()
    with pytest.raises(ConfigError, match="share_startup"):
        parse_space(space(share_startup="yes"), demo_cfg)
    with pytest.raises(ConfigError, match="total_time_s"):
        parse_space(space(budget={"total_time_s": -1}), demo_cfg)


def test_trial_runner_is_inline_only_for_one_worker_trials_and_says_why_not(demo_cfg):
    one = base_for_trials(demo_cfg, parse_space(space(fixed={"scaling.workers": "1"}), demo_cfg))
    two = base_for_trials(demo_cfg, parse_space(space(fixed={"scaling.workers": "2"}), demo_cfg))
    auto = parse_space(space(), demo_cfg)
    assert auto.trial_runner == "auto"
    assert trial_runner(auto, one) == "inline" and trial_runner(auto, two) == "train"
    searched = parse_space(space(params={**BASE["params"], "scaling.cpus_per_worker": {
        "dist": "choice", "values": [0.5, 1.0]}}), demo_cfg)
    assert trial_runner(searched, one) == "train"  # scaling.* searched: not decided per experiment
    forced = parse_space(space(trial_runner="train"), demo_cfg)
    assert trial_runner(forced, one) == "train"
    assert parse_space(yaml.safe_load(yaml.safe_dump(forced.to_dict())), demo_cfg).trial_runner == "train"
    with pytest.raises(ConfigError, match="trial_runner: bad value 'inline' with scaling.workers='2'"):
        trial_runner(parse_space(space(trial_runner="inline"), demo_cfg), two)
    with pytest.raises(ConfigError, match="trial_runner: bad value 'local'; allowed: auto, inline, train"):
        parse_space(space(trial_runner="local"), demo_cfg)


def test_inline_trial_holds_the_worker_cpus_in_its_own_bundle():
    cfg = load_config("demo", {"scaling.workers": "1", "scaling.cpus_per_worker": 0.5})
    assert trial_bundles(cfg, inline=True)[0] == {"CPU": 0.5}
    assert trial_bundles(cfg)[0]["CPU"] < 0.5  # a Train trial only waits on its worker group
    # The same trials fit either way: the worker's CPUs are counted once, in the bundle or in the group.
    assert fit_concurrency(cfg, 8, {"CPU": 4.0}, inline=True)[0] == fit_concurrency(cfg, 8, {"CPU": 4.0})[0]
