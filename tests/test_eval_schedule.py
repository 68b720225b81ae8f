"""``schedule.eval_every_epochs``: which epochs end with a validation, and what the epochs' records then hold.

The trainer's epoch end runs for real in this process (a one-rank gloo group, as tests/test_trainer.py), its
validation stream a Ray Data dataset on the session's local cluster, its checkpoints written by the one-worker
context to the run folder."""

import numpy as np
import pytest
import torch.distributed as dist

from lightray.comm.topology import Topology
from lightray.config import ConfigError, load_config
from lightray.data.ingest import IngestSpec, TierShards
from lightray.schedule import Schedule, validates_after
from lightray.train.context import LocalContext
from lightray.train.trainer import PhaseRun, Trainer
from tests.faults import records as run_records


@pytest.mark.parametrize(("every", "epochs", "validated"), [
    (1, 4, [1, 2, 3, 4]), (2, 4, [2, 4]), (3, 4, [3, 4]), (0, 4, [4]), (5, 4, [4]), (0, 1, [1])])
def test_the_validated_epochs_are_every_nth_and_the_last(every, epochs, validated):
    assert [e + 1 for e in range(epochs) if validates_after(e, epochs, every)] == validated


def test_the_units_line_names_the_validated_epochs_and_the_key():
    cfg = load_config("cifar10", {"schedule.eval_every_epochs": 4})
    line = Schedule(cfg.schedule, cfg.optim, 45000).describe_validation()
    assert "after epochs 4, 8, 9 of 9" in line and "schedule.eval_every_epochs=4" in line
    every = load_config("cifar10", {"schedule.eval_every_epochs": 1})
    assert Schedule(every.schedule, every.optim, 45000).describe_validation() == \
        "validation after each of the 9 epochs"
    shipped = load_config("cifar10", {})  # the 10-minute recipe validates once, at its end, as airbench94 times
    assert "after epoch 9 of 9" in Schedule(shipped.schedule, shipped.optim, 45000).describe_validation()


def test_a_negative_interval_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"schedule\.eval_every_epochs.*-1"):
        load_config("smoke", {"schedule.eval_every_epochs": -1})


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_epochs_off_the_interval_report_no_validation_figures_and_keep_none_from_before(
        tmp_path, ray_local, one_rank_group):
    rng = np.random.default_rng(0)
    val = ray_local.data.from_items([{"image": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8),
                                      "label": np.int64(i % 10)} for i in range(40)])
    cfg = load_config("smoke", {"schedule.epochs": 4, "schedule.eval_every_epochs": 2, "schedule.tta_flip": False})
    empty = TierShards(32, "raw", [], [], [])
    spec = IngestSpec(seed=cfg.scaling.seed, local_dir=str(tmp_path), train_size=256, phases=[], val=empty,
                      eval_resolution=32, val_crop_ratio=cfg.data.val_crop_ratio)
    saved: list = []
    records: list = []
    trainer = Trainer(cfg, spec, str(tmp_path), 10, rank=0, world=1, topology=Topology(1, 0, 0, 1, 0, 1),
                      report=records.append, ctx=LocalContext(str(tmp_path), {"val": val}, keep=4,
                                                              on_report=saved.append))
    run = PhaseRun(0, cfg.schedule.phases[0], 1.0)
    for epoch in range(4):
        trainer.end_epoch(epoch, run)
    lines = [r for r in records if "event" not in r and "epoch" in r]
    assert [r["epoch"] for r in lines] == [1, 2, 3, 4]
    # epoch 3 comes after epoch 2's validation: its line must not carry epoch 2's figures
    assert [sorted(k for k in r if k.startswith("val_")) for r in lines] == [
        [], ["val_loss", "val_samples", "val_top1", "val_top5"], [], ["val_loss", "val_samples", "val_top1",
                                                                      "val_top5"]]
    assert lines[1]["val_samples"] == lines[3]["val_samples"] == 40
    # every epoch still checkpoints, validated or not
    assert [m["epoch"] for m in saved] == [1, 2, 3, 4]
    assert trainer.counters.best_top1 == max(lines[1]["val_top1"], lines[3]["val_top1"])


def test_a_real_run_says_which_epochs_it_validates_and_validates_them(finished_run):
    """The session's finished smoke run (no new run): the default interval validates both of its epochs."""
    recs = run_records(finished_run)
    [unit] = [r for r in recs if r.get("unit") == "eval_schedule"]
    assert not unit["enabled"] and unit["message"] == "validation after each of the 2 epochs", unit
    assert [r["epoch"] for r in recs if "event" not in r and "val_top1" in r] == [1, 2]
