"""Augmentation on the device: the window + box + flip batches Ray Data tasks ship for raw tiers, cropped by one
batched roi_align on the worker's device, against the CPU path's PIL crops of the same stored demo images;
where ``data.augment_on`` sends each phase; and a real smoke run on the device path (CPU device here)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from lightray.data.ingest import IngestSpec, phase_blocks, plan_augmentation, train_block_batch
from lightray.data.manifest import Manifest
from lightray.data.plan import EpochPlan
from lightray.train import device as dev
from tests.crops import draw_crop
from tests.small_tiers import one_phase_spec, prepared_tier

ROOT = pathlib.Path(__file__).parents[1]
RES = 48  # output size; the stored raw tier is 64 px short side, so crops both shrink and grow


@pytest.fixture(scope="module")
def demo_manifest(tmp_path_factory) -> Manifest:
    yield from prepared_tier(tmp_path_factory.mktemp("device-aug"), raw_max_resolution=64)


def make_spec(manifest: Manifest, local_dir: str, augment_on: str, cuda: bool) -> IngestSpec:
    spec = one_phase_spec(manifest, local_dir, RES)
    plan_augmentation(spec, augment_on, cuda)
    return spec


def all_blocks(spec: IngestSpec) -> dict:
    blocks = phase_blocks(spec, 0, 0, 0)
    return {k: np.array([b[k] for b in blocks]) for k in ("epoch", "step0", "nsteps")}


def test_device_path_crops_match_the_cpu_path_on_demo_tier_images(demo_manifest, tmp_path):
    spec = make_spec(demo_manifest, str(tmp_path / "local"), "device", cuda=False)
    ph = spec.phases[0]
    assert ph.device_augment and ph.shards.fmt == "raw"
    blocks = all_blocks(spec)
    got = train_block_batch(blocks, spec=spec, phase=0, rank=0, world_size=1)
    assert got["image"].shape[1:] == (*ph.canvas, 3) and got["image"].dtype == np.uint8
    out = dev.crop_resize_flip(torch.from_numpy(got["image"]), torch.from_numpy(got["box"]),
                               torch.from_numpy(got["flip"]), RES)
    device_crops = out.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()

    spec.phases[0].device_augment = False  # the CPU path over the very same blocks
    cpu = train_block_batch(blocks, spec=spec, phase=0, rank=0, world_size=1)
    assert (cpu["sample_id"] == got["sample_id"]).all() and (cpu["epoch"] == got["epoch"]).all()
    assert (cpu["label"] == got["label"]).all()
    cpu_crops = cpu["image"].astype(np.float64)

    # Same boxes: the shipped box is the drawn one moved by whole pixels (the window's origin), same flip bit.
    plan = EpochPlan(ph.shards.rows, spec.seed)
    sizes = {}
    for e in (0, 1):
        idx, rows = plan.to_shard_row(plan.order(e))
        for px, _lab, sid in ph.shards.arrays(spec.local_dir, idx, rows):
            sizes[sid] = px.shape
    for i, (sid, epoch) in enumerate(zip(got["sample_id"].tolist(), got["epoch"].tolist())):
        h, w = sizes[sid][:2]
        box, flip = draw_crop(spec.seed, epoch, sid, w, h, ph.min_scale)
        shift = np.asarray(box, np.float64) - got["box"][i]
        assert np.allclose(shift, np.round(shift), atol=1e-3), shift
        assert round(shift[0]) == round(shift[2]) and round(shift[1]) == round(shift[3]), shift
        assert bool(got["flip"][i]) == flip
    assert 0 < got["flip"].sum() < len(got["flip"])  # both flip values were exercised

    err = np.abs(device_crops.astype(np.float64) - cpu_crops).mean(axis=(1, 2, 3))
    err_flipped = np.abs(device_crops[:, :, ::-1].astype(np.float64) - cpu_crops).mean(axis=(1, 2, 3))
    assert err.mean() < 6.0 and err.max() < 12.0, (err.mean(), err.max())
    # The flips agree: every crop is closer to the CPU crop than to its own mirror image.
    assert (err < err_flipped).all(), np.flatnonzero(err >= err_flipped)


def test_alternating_flips_show_each_image_the_other_way_in_the_next_epoch_on_both_paths(demo_manifest, tmp_path):
    """data.flip=alternate reaches the tasks' batches: the device path's flip bits and the CPU path's pixels."""
    spec = make_spec(demo_manifest, str(tmp_path / "local"), "device", cuda=False)
    spec.flip = "alternate"
    blocks = all_blocks(spec)
    got = train_block_batch(blocks, spec=spec, phase=0, rank=0, world_size=1)
    flips = {(sid, e): bool(f) for sid, e, f in zip(got["sample_id"].tolist(), got["epoch"].tolist(), got["flip"])}
    ids = sorted({sid for sid, _e in flips})
    assert {e for _sid, e in flips} == {0, 1} and len(flips) == 2 * len(ids)
    assert all(flips[(sid, 0)] != flips[(sid, 1)] for sid in ids), flips
    assert 0 < sum(flips[(sid, 0)] for sid in ids) < len(ids)  # both ways in one epoch
    # The CPU path at crop scale 1 (the whole image, every epoch): epoch 1 shows epoch 0's mirror image.
    spec.phases[0].device_augment, spec.phases[0].min_scale = False, 1.0
    cpu = train_block_batch(blocks, spec=spec, phase=0, rank=0, world_size=1)
    img = {(sid, e): im for sid, e, im in zip(cpu["sample_id"].tolist(), cpu["epoch"].tolist(), cpu["image"])}
    for sid in ids:
        assert np.array_equal(img[(sid, 1)], img[(sid, 0)][:, ::-1]), sid


def test_augment_on_chooses_the_device_on_cuda_workers_and_the_cpu_otherwise(demo_manifest, tmp_path):
    local = str(tmp_path / "local")
    assert make_spec(demo_manifest, local, "auto", cuda=True).phases[0].device_augment
    spec = make_spec(demo_manifest, local, "auto", cuda=False)
    assert not spec.phases[0].device_augment and spec.augment_on == "cpu"
    assert not make_spec(demo_manifest, local, "cpu", cuda=True).phases[0].device_augment
    ev = [e for e in make_spec(demo_manifest, local, "device", cuda=False).events if e["unit"] == "augment_on"]
    assert ev[0]["on"] == "device" and ev[0]["device"] == "cpu" and "on the CPU device" in ev[0]["message"]


def test_device_path_is_refused_for_a_jpeg_tier_and_the_event_says_why(demo_manifest, tmp_path):
    spec = make_spec(demo_manifest, str(tmp_path / "local"), "device", cuda=True)
    spec.phases[0].shards.fmt = "jpeg"  # as a tier above data.raw_max_resolution is stored
    plan_augmentation(spec, "device", True)
    assert not spec.phases[0].device_augment
    assert "needs a raw tier" in spec.events[-1]["message"]
