"""With no --config, the recipe is picked from the data (native size, images, classes) and the hardware, and the
run says in one line what it picked and why (app/recipe_pick.py)."""

from __future__ import annotations

import io
import json
import pathlib

import numpy as np
import pytest
from PIL import Image

from lightray import cli
from lightray.config import load_config
from lightray.recipe_pick import MIN_IMAGES, DataFacts, choose, gpus_here


def class_folders(root: pathlib.Path, size: int, per_class: int, classes: int = 4) -> pathlib.Path:
    """A bare tree of class folders (no train/ split folder) of real ``size`` px JPEGs, one encoded photo per
    class written ``per_class`` times: the pick reads headers, so copies keep the tree cheap to make."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        folder = root / f"n0{c}"
        folder.mkdir(parents=True)
        arr = (rng.random((size, size + size // 3, 3)) * 255).astype(np.uint8)  # landscape: short side = size
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=85)
        for i in range(per_class):
            (folder / f"{i:05d}.JPEG").write_bytes(buf.getvalue())
    return root


def picked(tmp_path: pathlib.Path, *argv: str, capsys) -> tuple[object, str]:
    args, rest = cli.build_parser("train").parse_known_args(list(argv))
    cfg = cli.config_from_args(args, rest)
    assert cli.picks_recipe(args, cfg)
    out = cli.picked_config(args, rest, cfg)
    return out, capsys.readouterr().out


def test_a_bare_tree_of_imagenet_sized_photos_on_cpus_gets_the_imagenette_recipe(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # this machine's CPUs whatever it has
    src = class_folders(tmp_path / "photos", 160, per_class=MIN_IMAGES // 4)
    cfg, out = picked(tmp_path, "--data", str(src), "--storage", str(tmp_path / "runs"), "--schedule.epochs=2",
                      capsys=capsys)
    assert cfg.recipe == "imagenette" and cfg.model.arch == load_config("imagenette").model.arch
    assert cfg.schedule.epochs == 2, "the user's own overrides still apply on the picked recipe"
    line = [ln for ln in out.splitlines() if ln.startswith("lightray: recipe")]
    assert len(line) == 1, out
    assert "imagenette" in line[0] and "160 px" in line[0] and f"{MIN_IMAGES:,} training images" in line[0]
    assert "in 4 classes" in line[0] and "no GPU" in line[0]
    # The probe is kept where prepare looks for it: prepare does not sample the photos again.
    kept = list((tmp_path / "runs" / "cache" / "_native").glob("*.json"))
    assert [json.loads(p.read_text())["native_short_side"] for p in kept] == [160]


def test_small_photos_get_the_cifar_recipe_and_few_mid_sized_photos_the_demo(tmp_path, capsys):
    cfg, out = picked(tmp_path, "--data", str(class_folders(tmp_path / "small", 32, per_class=30)),
                      "--storage", str(tmp_path / "runs"), capsys=capsys)
    assert cfg.recipe == "cifar10" and "32 px" in out and "CIFAR-sized" in out
    cfg, out = picked(tmp_path, "--data", str(class_folders(tmp_path / "mid", 128, per_class=30)),
                      "--storage", str(tmp_path / "runs"), capsys=capsys)
    assert cfg.recipe == "demo" and "fewer than" in out


def test_a_named_recipe_or_the_smoke_test_is_never_replaced(tmp_path):
    for argv in (["--data", str(tmp_path), "--config", "demo"], ["--data", str(tmp_path), "--smoke-test"], []):
        args, rest = cli.build_parser("train").parse_known_args(argv)
        assert not cli.picks_recipe(args, cli.config_from_args(args, rest)), argv


def test_a_missing_source_with_no_recipe_is_a_usage_error_naming_it(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert cli.main(["train", "--data", str(missing), "--storage", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "lightray: error:" in err


@pytest.mark.parametrize("facts, gpus, recipe", [
    (DataFacts(None, 50_000, 10), 0, "demo"),
    (DataFacts(32, 50_000, 10), 8, "cifar10"),
    (DataFacts(40, 500, 10), 0, "cifar10"),
    (DataFacts(375, 1_281_167, 1000), 8, "imagenet-rn18-16ep"),
    (DataFacts(375, 1_281_167, 1000), 0, "imagenette"),
    (DataFacts(224, 9_469, 10), 1, "imagenette"),
    (DataFacts(224, -1, 0), 0, "imagenette"),  # tar shards: counted only once read
    (DataFacts(224, MIN_IMAGES - 1, 10), 0, "demo"),
    (DataFacts(64, 100_000, 10), 0, "demo"),
])
def test_the_rules_pick_by_size_count_and_gpus(facts, gpus, recipe):
    pick = choose(facts, gpus)
    assert pick.recipe == recipe, pick.line()
    load_config(pick.recipe, pick.overrides)  # every pick is a recipe that loads with its overrides


def test_imagenet_scale_on_gpus_takes_one_worker_a_gpu():
    pick = choose(DataFacts(375, 1_281_167, 1000), 4)
    assert pick.overrides == {"scaling.workers": "4"} and "4 GPU(s)" in pick.reason


def test_gpus_follow_the_visible_devices_and_the_use_gpu_setting(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus_here("auto") == 0
    assert gpus_here("true") == 1  # told there is one: the GPU recipes, whatever this driver's machine has
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpus_here("false") == 0
