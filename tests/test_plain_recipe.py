"""bench/plain_recipe.py, the same-recipe plain baseline: a tree of images of many sizes is held decoded once per
phase size, each image is cropped within its own pixels, never the canvas's padding, and the loop validates on
lightray's evaluation interval."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch
from PIL import Image

from bench.plain_recipe import load_tree, random_resized_crop, run, tree_samples
from lightray.config import load_config


def _tree(root: pathlib.Path) -> None:
    rng = np.random.default_rng(0)
    sizes = {"train": [(40, 30), (30, 50), (64, 64)], "val": [(48, 36), (36, 36)]}
    for split, whs in sizes.items():
        for i, (w, h) in enumerate(whs):
            cls = root / split / f"c{i % 2}"
            cls.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(cls / f"{i}.png")


def test_a_tree_is_held_once_per_phase_size_with_each_images_own_size(tmp_path):
    _tree(tmp_path)
    got = load_tree(str(tmp_path), [16, 24], eval_size=20, eval_tier=24, crop_ratio=0.875)
    assert got["classes"] == ["c0", "c1"] and got["val_cropped"] is True
    assert got["native_short_side"] == 30  # median short side of 30, 30, 64
    for size, (canvas, labels, hw) in got["train_by_res"].items():
        assert hw.min(1).tolist() == [size] * 3  # every image's short side is the phase's size
        assert canvas.shape == (3, hw[:, 0].max(), hw[:, 1].max(), 3) and canvas.dtype == np.uint8
        assert labels.tolist() == [0, 0, 1]  # ImageFolder order: by class, then by file
        for img, (h, w) in zip(canvas, hw):  # padded with each image's own edge pixels
            assert (img[h:, :w] == img[h - 1:h, :w]).all() and (img[:, w:] == img[:, w - 1:w]).all()
    xs, ys = got["val"]
    assert xs.shape == (2, 20, 20, 3) and ys.tolist() == [0, 1]
    assert got["train"][0] is got["train_by_res"][24][0]


def test_a_bare_tree_of_class_folders_is_held_out_and_limited_as_a_run_prepares_it(tmp_path):
    # The plain baseline must score the photos the run scores: the run's seeded hold-out and evenly spaced limit.
    from lightray.data.prepare import selected_ids
    from lightray.data.sources import list_source

    rng = np.random.default_rng(1)
    for c in range(3):
        (tmp_path / f"n{c}").mkdir()
        for i in range(20):
            Image.fromarray(rng.integers(0, 255, (12, 16, 3), dtype=np.uint8)).save(tmp_path / f"n{c}" / f"{i}.png")
    classes, got = tree_samples(str(tmp_path), 0.2, 7, {"train": 30})
    listing = list_source(str(tmp_path), 0.2, 7, True)
    val = listing.splits["val"].table.to_pydict()
    assert classes == ["n0", "n1", "n2"]
    assert got["val"] == [(f"{tmp_path}/{p}", lab) for p, lab in zip(val["path"], val["label"])]
    assert len(got["val"]) == 12 and sorted({lab for _p, lab in got["val"]}) == [0, 1, 2]  # 4 of 20 per class
    train = listing.splits["train"].table.to_pydict()
    assert got["train"] == [(f"{tmp_path}/{train['path'][i]}", train["label"][i]) for i in selected_ids(48, 30)]
    assert not {p for p, _ in got["train"]} & {p for p, _ in got["val"]}
    other = tree_samples(str(tmp_path), 0.2, 8)[1]["val"]
    assert other != got["val"]  # the seed draws the hold-out


@pytest.mark.parametrize("hw_known", [True, False])
def test_crops_stay_inside_each_images_own_pixels(hw_known):
    # Two white images top-left on a black canvas of 32 x 32, each with the one row and column of its own edge
    # that bilinear sampling at its border reads: crops that know each image's size see only white.
    x = torch.zeros(2, 3, 32, 32)
    x[0, :, :9, :21] = 1.0
    x[1, :, :25, :13] = 1.0
    hw = np.array([[8, 20], [24, 12]])
    gen = torch.Generator().manual_seed(0)
    outs = [random_resized_crop(x, 16, 0.3, gen, hw if hw_known else None) for _ in range(20)]
    low = min(float(o.min()) for o in outs)
    if hw_known:
        assert low > 0.99
    else:
        assert low < 0.5  # without the sizes the crops take the canvas's black padding


def test_the_loop_validates_on_the_recipes_evaluation_interval():
    rng = np.random.default_rng(0)
    arrays = {"classes": ["a", "b"], "train": (rng.integers(0, 256, (64, 32, 32, 3), dtype=np.uint8),
                                               rng.integers(0, 2, 64).astype(np.int64)),
              "val": (rng.integers(0, 256, (16, 32, 32, 3), dtype=np.uint8), rng.integers(0, 2, 16).astype(np.int64))}
    cfg = load_config("smoke", {"schedule.epochs": 3, "schedule.eval_every_epochs": 2,
                                "schedule.phases": [{"until": 1.0, "resolution": 32, "batch_size": 32}]})
    history, _startup = run(cfg, arrays, targets=[1.1], threads=1, seed=0)
    assert [r["epoch"] for r in history] == [2, 3]
    assert history[0]["train_s"] < history[1]["train_s"]
