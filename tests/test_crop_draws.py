"""The training crops' random draws: a block's draws are computed at once, yet each sample's depend only on its
own (seed, epoch, sample id); the boxes follow torchvision's RandomResizedCrop (area scale, log-uniform aspect,
its fallback) and the flips are fair coins."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torchvision.transforms import RandomResizedCrop

from lightray.data import augment
from tests.crops import draw_crop

SEED = 11


def test_a_samples_draws_do_not_depend_on_the_block_it_is_drawn_in():
    rng = np.random.default_rng(0)
    n = 300
    ids = rng.integers(0, 10**9, n)
    epochs = rng.integers(0, 90, n)
    heights, widths = rng.integers(20, 900, n), rng.integers(20, 900, n)
    boxes, flips = augment.draw_crops(SEED, epochs, ids, heights, widths, 0.08)
    perm = rng.permutation(n)[:77]  # another block: a shuffled subset
    sub_boxes, sub_flips = augment.draw_crops(SEED, epochs[perm], ids[perm], heights[perm], widths[perm], 0.08)
    assert np.array_equal(sub_boxes, boxes[perm]) and np.array_equal(sub_flips, flips[perm])
    for i in range(0, n, 37):  # and a block of one
        box, flip = draw_crop(SEED, int(epochs[i]), int(ids[i]), int(widths[i]), int(heights[i]), 0.08)
        assert box == tuple(boxes[i].tolist()) and flip == bool(flips[i])


def test_draws_change_with_seed_epoch_and_sample_id():
    ids = np.arange(200)
    base = augment.sample_uniforms(SEED, np.zeros(200, np.int64), ids, 23)
    for other in (augment.sample_uniforms(SEED + 1, np.zeros(200, np.int64), ids, 23),
                  augment.sample_uniforms(SEED, np.ones(200, np.int64), ids, 23),
                  augment.sample_uniforms(SEED, np.zeros(200, np.int64), ids + 1, 23)):
        assert (other != base).mean() > 0.99
    assert len(np.unique(base)) == base.size  # no two draws of these samples collide
    assert 0.0 <= base.min() and base.max() < 1.0
    # uniform: each decile holds about a tenth of 4,600 draws
    counts = np.histogram(base, bins=10, range=(0, 1))[0]
    assert np.abs(counts - base.size / 10).max() < 4 * math.sqrt(base.size / 10), counts


@pytest.mark.parametrize("size,min_scale", [((375, 500), 0.35), ((300, 300), 0.08), ((128, 900), 0.5)])
def test_boxes_follow_torchvisions_random_resized_crop(size, min_scale):
    h, w = size
    n = 4000
    boxes, flips = augment.draw_crops(SEED, np.zeros(n, np.int64), np.arange(n), np.full(n, h), np.full(n, w),
                                      min_scale)
    bw, bh = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    assert (boxes[:, 0] >= 0).all() and (boxes[:, 1] >= 0).all()
    assert (boxes[:, 2] <= w + 1e-9).all() and (boxes[:, 3] <= h + 1e-9).all()
    assert (bw / bh >= 3 / 4 - 1e-9).all() and (bw / bh <= 4 / 3 + 1e-9).all()
    assert abs(flips.mean() - 0.5) < 4 * math.sqrt(0.25 / n)
    # torchvision's own sampler on the same image size: the same distribution of area scale and aspect
    torch.manual_seed(0)
    ref = np.array([RandomResizedCrop.get_params(torch.empty(1, h, w), [min_scale, 1.0], [3 / 4, 4 / 3])
                    for _ in range(n)], np.float64)  # (top, left, height, width), integer boxes
    ours_area, ref_area = bw * bh / (w * h), ref[:, 2] * ref[:, 3] / (w * h)
    ours_aspect, ref_aspect = np.log(bw / bh), np.log(ref[:, 3] / ref[:, 2])
    for ours, theirs in ((ours_area, ref_area), (ours_aspect, ref_aspect)):
        # integer rounding of torchvision's boxes moves its means a little; 5 standard errors of the difference
        tol = 5 * math.sqrt((ours.var() + theirs.var()) / n) + 0.01
        assert abs(ours.mean() - theirs.mean()) < tol, (ours.mean(), theirs.mean())
        assert abs(np.median(ours) - np.median(theirs)) < 2 * tol
    # the box's centre is uniform over where it can go: its x offset over the room it has averages a half
    room = w - bw
    moved = room > 1
    assert abs((boxes[moved, 0] / room[moved]).mean() - 0.5) < 0.03


def test_no_try_fitting_falls_back_to_the_largest_centred_box_within_the_ratio():
    # min_scale 1: only an aspect of exactly the image's can fit, so a 1 x 9 panorama always falls back
    boxes, _ = augment.draw_crops(SEED, np.zeros(50, np.int64), np.arange(50), np.full(50, 90), np.full(50, 810),
                                  1.0)
    assert np.allclose(boxes, [(810 - 120) / 2, 0, (810 + 120) / 2, 90])  # width 90 * 4/3, centred
    boxes, _ = augment.draw_crops(SEED, np.zeros(5, np.int64), np.arange(5), np.full(5, 810), np.full(5, 90), 1.0)
    assert np.allclose(boxes, [0, (810 - 120) / 2, 90, (810 + 120) / 2])  # height 90 * 4/3, centred


def test_alternating_flips_mirror_each_image_once_in_any_two_epochs_from_a_seeded_coin():
    import numpy as np
    import pytest

    from lightray.data.augment import alternating_flips, choose_flips

    ids = np.arange(10_000, dtype=np.int64) * 7 + 3
    first, second, third = (alternating_flips(1, np.full(len(ids), e), ids) for e in (0, 1, 2))
    assert (first != second).all() and (first == third).all()  # the other way every next epoch
    assert 0.48 < first.mean() < 0.52  # a fair coin per image in the first epoch
    assert (alternating_flips(1, np.zeros(len(ids)), ids) != alternating_flips(2, np.zeros(len(ids)), ids)).any()
    drawn = np.zeros(len(ids), bool)
    assert choose_flips("random", 1, np.zeros(len(ids)), ids, drawn) is drawn
    assert (choose_flips("alternate", 1, np.ones(len(ids)), ids, drawn) == second).all()
    with pytest.raises(ValueError, match="data.flip: bad value 'sometimes'"):
        choose_flips("sometimes", 1, np.zeros(3), ids[:3], drawn[:3])
