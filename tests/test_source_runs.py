"""One real smoke run per kind of source, each checking everything that kind must do end to end:

- class-sorted Parquet rows: mixed into shards that each hold every class, so the run learns as if shuffled;
- class-sorted WebDataset tars (one tar per class): the same;
- an ImageFolder tree with no val/ split at a native 32 px: the seeded hold-out and the native-size rule, on a
  timm architecture (a model that is not lightray's or torchvision's, through DDP and the model units) and on
  the device augmentation path (the CPU device here).

Each is `python app/run.py --smoke-test --data SRC` on a local Ray cluster with 2 gloo workers."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from lightray.data.source import DEFAULT_VAL_FRACTION
from tests.photos import photo_tree
from tests.test_source_order import make_class_tars, make_hf_parquet
from tests.test_sources import CLASSES

pytestmark = [pytest.mark.slow, pytest.mark.shares_cpu]  # three real runs: about 3 minutes on 2 cores

REPO = pathlib.Path(__file__).resolve().parents[1]
TIMM_ARCH = "timm:mobilenetv3_small_050"  # ~0.6M parameters: a timm model small enough for two CPU workers
# The smoke recipe on these sources: 3 classes whose dominant colour channel is the label. 95% is what shuffled
# rows reach; a run that sees one class per shard (class-sorted rows left in order) scored 66.7%.
LEARNED = 0.95


def smoke_run(src: pathlib.Path, storage: pathlib.Path, *args: str) -> tuple[pathlib.Path, str]:
    proc = subprocess.run(
        [sys.executable, "app/run.py", "--smoke-test", "--data", str(src), "--storage", str(storage), "--name", "s",
         "--scaling.ray_address=local", f"--data.cache_dir={storage / 'cache'}", *args],
        cwd=REPO, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = storage / "s"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["epochs"] == 2
    return run_dir, proc.stdout


def records(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_records(run_dir: pathlib.Path) -> list[dict]:
    return [r for r in records(run_dir) if "event" not in r and "val_top1" not in r]


def top1(run_dir: pathlib.Path) -> float:
    return float(json.loads((run_dir / "summary.json").read_text())["final_top1"])


# --- class-sorted Parquet ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def parquet_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("parquet")
    # 240 rows in class order, cut into 8 shards of 30 rows: on plain row ranges each shard holds one class.
    make_hf_parquet(root / "src", per_class=80, sort=True)
    return smoke_run(root / "src", root / "runs", "--data.shard_rows=32")[0]


def test_class_sorted_parquet_trains_to_the_accuracy_of_shuffled_rows(parquet_run):
    assert top1(parquet_run) >= LEARNED


def test_parquet_source_keeps_its_hugging_face_class_names(parquet_run):
    assert json.loads((parquet_run / "classes.json").read_text()) == list(CLASSES)
    data = json.loads((parquet_run / "data.json").read_text())
    assert data["train_samples"] == 240 and data.get("holdout") is None  # its validation file is the val split


# --- class-sorted WebDataset tars -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tars_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tars")
    # No corrupt key here (test_source_order checks that one is skipped and listed): 12 steps are on an edge on
    # these tars, and with one row fewer (239) or the tier stored raw this run scored 66.7% (one class lost).
    make_class_tars(root / "src", per_class=80)
    return smoke_run(root / "src", root / "runs", "--data.shard_rows=32")[0]


def test_class_sorted_tars_train_to_the_accuracy_of_shuffled_rows(tars_run):
    assert top1(tars_run) >= LEARNED
    assert json.loads((tars_run / "classes.json").read_text()) == list(CLASSES)
    assert json.loads((tars_run / "data.json").read_text())["train_samples"] == 240


# --- a folder of class folders (torchvision's ImageFolder, no split folders) at a native 32 px -----------------
@pytest.fixture(scope="module")
def train_only_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainonly")
    src = photo_tree(root / "src", 32, per_class=40)
    shutil.rmtree(src / "val")  # no val split: the run holds one out of the class folders
    for cls in (src / "train").iterdir():
        cls.rename(src / cls.name)
    (src / "train").rmdir()
    # Every step reported: 4 steps in all (108 train images). LR 0.1 per 256: at the smoke recipe's 0.4 this
    # timm model's loss rose (1.92 -> 5.97 over the run).
    return smoke_run(src, root / "runs", "--data.val_seed=5", f"--model.arch={TIMM_ARCH}", "--optim.lr_per_256=0.1",
                     "--report.every_steps=1", "--data.augment_on=device", "--data.raw_max_resolution=64")


def test_a_folder_of_class_folders_trains_with_a_seeded_stratified_hold_out(train_only_run):
    run_dir, _ = train_only_run
    recorded = json.loads((run_dir / "data.json").read_text())
    assert recorded["holdout"]["val_fraction"] == DEFAULT_VAL_FRACTION and recorded["holdout"]["seed"] == 5
    assert recorded["holdout"]["train_val_per_class"] == {"c0": [36, 4], "c1": [36, 4], "c2": [36, 4]}
    assert recorded["val_samples"] == 12
    manifest = json.loads((pathlib.Path(recorded["manifest"]) / "manifest.json").read_text())
    assert manifest["holdout"] == recorded["holdout"]  # the cache, resume and eval read the same split


def test_32px_photos_train_at_32px_at_most_and_the_run_says_so(train_only_run):
    run_dir, stdout = train_only_run
    assert "phase 1: 48 px clipped to the source's native 32 px" in stdout
    data = json.loads((run_dir / "data.json").read_text())
    assert data["native_short_side"] == 32 and data["phase_tiers"] == [32, 32] and data["val_tier"] == 32
    assert {r["resolution"] for r in train_records(run_dir)} == {32}


def test_a_timm_arch_trains_through_the_run_and_its_units_say_what_applies(train_only_run):
    # Its loss falls; its accuracy is not checked: this small timm model stays near chance in a smoke run on every
    # source tried here (33-34% on 3 classes), where the smoke recipe's resnet_tiny reaches 100%.
    run_dir, _ = train_only_run
    train = train_records(run_dir)
    assert {r["world_size"] for r in train} == {2}
    assert min(r["loss"] for r in train[-3:]) < train[0]["loss"], [r["loss"] for r in train]
    units = {r["unit"]: r for r in records(run_dir) if r.get("event") == "unit"}
    # Units that do not apply to this model say so instead of silently doing nothing.
    assert "not applicable" in units["zero_init_residual"]["message"]
    assert units["model"]["message"].startswith(TIMM_ARCH)
    model = json.loads((run_dir / "model" / "model.json").read_text())
    assert model["arch"] == TIMM_ARCH and model["num_classes"] == 3


def test_device_augmentation_ran_on_the_cpu_device_and_said_so(train_only_run):
    run_dir, _ = train_only_run
    lines = records(run_dir)
    units = [r for r in lines if r.get("event") == "unit" and r.get("unit") == "augment_on"]
    worker = [u for u in units if "phases" in u]
    assert worker and worker[0]["on"] == "device" and worker[0]["device"] == "cpu"
    assert "device path on the CPU device" in worker[0]["message"]
    train = train_records(run_dir)
    assert {r["resolution"] for r in train} == {32}  # 48 px clipped to the photos' 32
    assert all(np.isfinite(r["loss"]) for r in train)
