"""A run of one worker in the driver's process (``run_training(inline=True)``, what a search's one-worker
trials use) against the same run as a Ray Train worker group of one, on a real local Ray cluster."""

from __future__ import annotations

import json
import pathlib

import pytest

from lightray.config import ConfigError, load_config
from lightray.train.state import list_checkpoints

pytestmark = [pytest.mark.slow, pytest.mark.shares_cpu]  # three real runs in this process


def _validations(run_dir: pathlib.Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "val_loss" in r and "event" not in r]


def test_inline_run_trains_what_a_worker_group_trains_and_resumes_from_its_own_checkpoints(
        tmp_path, ray_local, smoke_overrides):
    from lightray.driver.runner import run_training

    over = {**smoke_overrides, "storage": str(tmp_path), "scaling.workers": "1", "report.eval_sweep": [],
            "report.tensorboard": False, "schedule.epochs": 3, "checkpoint.keep": 2}
    run_training(load_config("smoke", {**over, "name": "group"}), progress=False)

    reports: list[dict] = []
    # Stopped part-way (4 steps an epoch: epoch 1's checkpoint, then one at step 5), then resumed in a second
    # call, both in this process.
    stopped = load_config("smoke", {**over, "name": "inline", "checkpoint.stop_after_steps": 5})
    run_training(stopped, progress=False, inline=True, on_report=reports.append)
    assert [s for s, _ in list_checkpoints(str(tmp_path / "inline"))] == [5 * 64, 4 * 64]
    run_training(load_config("smoke", {**over, "name": "inline"}), resume=True, progress=False, inline=True,
                 on_report=reports.append)

    group, inline = _validations(tmp_path / "group"), _validations(tmp_path / "inline")
    assert [r["epoch"] for r in inline] == [r["epoch"] for r in group] == [1, 2, 3]
    # Same data order, augmentation, weights and updates: the same validation numbers, epoch by epoch.
    for g, i in zip(group, inline):
        assert i["val_loss"] == pytest.approx(g["val_loss"], rel=1e-5), (g, i)
        assert i["val_top1"] == pytest.approx(g["val_top1"], abs=1e-9)
    # Every checkpoint report reached on_report (what Tune gets), and only checkpoint.keep folders are kept,
    # in Ray Train's layout, the newest last written.
    assert [r.get("epoch") for r in reports if "val_loss" in r][-3:] == [1, 2, 3]
    kept = list_checkpoints(str(tmp_path / "inline"))
    assert len(kept) == 2 and kept[0][0] == group[-1]["samples_seen"]
    assert json.loads((tmp_path / "inline" / "summary.json").read_text())["status"] == "finished"
    lines = (tmp_path / "inline" / "metrics.jsonl").read_text().splitlines()
    events = [json.loads(line).get("event") for line in lines]
    assert events.count("start") == 1 and events.count("restart") == 1


def test_inline_run_refuses_more_than_one_worker(tmp_path, ray_local, smoke_overrides):
    from lightray.driver.runner import run_training

    cfg = load_config("smoke", {**smoke_overrides, "storage": str(tmp_path), "name": "two"})  # smoke: 2 workers
    with pytest.raises(ConfigError, match="scaling.workers.*expected exactly 1"):
        run_training(cfg, progress=False, inline=True)
    assert not list_checkpoints(str(tmp_path / "two"))
