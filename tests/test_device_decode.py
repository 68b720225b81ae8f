"""Decode on the device for JPEG tiers: Ray Data tasks ship the stored JPEG bytes with each sample's crop box and
flip bit, the worker decodes the batch with decode_jpeg (the CPU device here) and crops it with the device path's
batched roi_align; checked against the CPU path's PIL decode + crop of the same prepared shards, with a damaged
image skipped without shifting labels, and ``data.decode_on=auto`` on CPU workers keeping the CPU path."""

from __future__ import annotations

import io
import pathlib

import numpy as np
import pytest
import torch
from PIL import Image

from lightray.data import device_decode
from lightray.data.ingest import IngestSpec, PhaseSpec, phase_blocks, plan_decode, tier_shards, train_block_batch
from lightray.data.manifest import Manifest
from lightray.train import device as dev
from tests.crops import draw_crop
from tests.small_tiers import one_phase_spec, prepared_tier

RES = 48  # output size; the stored JPEG tier is 64 px short side, so crops both shrink and grow


@pytest.fixture(scope="module")
def jpeg_manifest(tmp_path_factory) -> Manifest:
    # raw_max_resolution=0: every tier is stored as JPEG, as tiers above data.raw_max_resolution are.
    yield from prepared_tier(tmp_path_factory.mktemp("device-decode"), raw_max_resolution=0)


def make_spec(manifest: Manifest, local_dir: str, decode_on: str, cuda: bool) -> IngestSpec:
    spec = one_phase_spec(manifest, local_dir, RES)
    plan_decode(spec, decode_on, cuda, cpus_per_gpu=2.0, seconds=0.2)
    return spec


def all_blocks(spec: IngestSpec) -> dict:
    blocks = phase_blocks(spec, 0, 0, 0)
    return {k: np.array([b[k] for b in blocks]) for k in ("epoch", "step0", "nsteps")}


def device_crops(batch: dict) -> tuple[np.ndarray, device_decode.DecodedBatch]:
    d = device_decode.decode_batch(batch, "cpu")
    out = dev.crop_resize_flip(d.canvas, d.boxes, d.flips, RES)
    return out.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy().astype(np.float64), d


def test_device_decode_matches_the_cpu_path_on_prepared_jpeg_shards(jpeg_manifest, tmp_path):
    spec = make_spec(jpeg_manifest, str(tmp_path / "local"), "device", cuda=False)
    ph = spec.phases[0]
    assert ph.shards.fmt == "jpeg" and ph.device_decode and spec.decode_on == "device"
    ev = [e for e in spec.events if e["unit"] == "decode_on"]
    assert ev[0]["on"] == "device" and ev[0]["device"] == "cpu" and "on the CPU device" in ev[0]["message"]
    assert "on the CPU device" in device_decode.describe(torch.device("cpu"), [0])  # the worker's own line
    blocks = all_blocks(spec)
    got = train_block_batch(blocks, spec=spec, phase=0, rank=0, world_size=1)
    assert got["jpeg"].dtype == object and all(bytes(b[:2]) == b"\xff\xd8" for b in got["jpeg"])  # JPEG SOI

    ph.device_decode = False  # the CPU path (PIL decode + crop in the task) over the very same blocks
    cpu = train_block_batch(blocks, spec=spec, phase=0, rank=0, world_size=1)
    assert (cpu["sample_id"] == got["sample_id"]).all() and (cpu["epoch"] == got["epoch"]).all()
    assert (cpu["label"] == got["label"]).all()

    # The boxes and flips are the draws of (seed, epoch, sample id), in stored-image pixels.
    for i, (sid, epoch) in enumerate(zip(got["sample_id"].tolist(), got["epoch"].tolist())):
        w, h = Image.open(io.BytesIO(got["jpeg"][i])).size
        box, flip = draw_crop(spec.seed, epoch, sid, w, h, ph.min_scale)
        assert np.allclose(got["box"][i], box, atol=1e-3) and bool(got["flip"][i]) == flip
    assert 0 < got["flip"].sum() < len(got["flip"])  # both flip values were exercised

    crops, d = device_crops(got)
    assert d.keep.all() and not d.skipped
    ref = cpu["image"].astype(np.float64)
    err = np.abs(crops - ref).mean(axis=(1, 2, 3))
    err_flipped = np.abs(crops[:, :, ::-1] - ref).mean(axis=(1, 2, 3))
    assert err.mean() < 6.0 and err.max() < 12.0, (err.mean(), err.max())
    assert (err < err_flipped).all(), np.flatnonzero(err >= err_flipped)  # flips agree
    assert abs(crops.mean() - ref.mean()) < 2.0  # same brightness overall: same decode (libjpeg-turbo both)

    # A damaged image: the batch decodes image by image, the bad one is dropped and listed, no label shifts.
    bad = got["jpeg"].copy()
    bad[3] = bad[3][:len(bad[3]) // 3]
    crops_bad, d_bad = device_crops({**got, "jpeg": bad})
    assert d_bad.skipped == [int(got["sample_id"][3])] and int(got["sample_id"][3]) in device_decode.SKIPPED
    assert not d_bad.keep[3] and d_bad.keep.sum() == len(bad) - 1
    assert np.array_equal(crops_bad, crops[d_bad.keep])  # every other sample keeps its own crop (and label)


def test_decode_on_auto_keeps_the_cpu_path_on_cpu_workers_and_says_why(jpeg_manifest, tmp_path):
    spec = make_spec(jpeg_manifest, str(tmp_path / "local"), "auto", cuda=False)
    assert not spec.phases[0].device_decode and spec.decode_on == "cpu"
    ev = [e for e in spec.events if e["unit"] == "decode_on"]
    assert len(ev) == 1 and ev[0]["on"] == "cpu" and ev[0]["device"] == "cpu"
    assert "decode_on=auto and the workers have no GPU" in ev[0]["message"]
    got = train_block_batch(all_blocks(spec), spec=spec, phase=0, rank=0, world_size=1)
    assert "jpeg" not in got and got["image"].shape[1:] == (RES, RES, 3)
    # cpu forces the CPU path on CUDA workers too; an object-store tier has nothing left to decode.
    assert not make_spec(jpeg_manifest, str(tmp_path / "local"), "cpu", cuda=True).phases[0].device_decode
    spec = IngestSpec(seed=5, local_dir=str(tmp_path / "local"), train_size=jpeg_manifest.num_samples("train"),
                      phases=[PhaseSpec(0, RES, 16, 0.25, 0, 2, tier_shards(jpeg_manifest, "train", 64))],
                      val=tier_shards(jpeg_manifest, "val", 64), eval_resolution=RES, val_crop_ratio=0.875)
    spec.phases[0].shards.refs = []
    plan_decode(spec, "device", False, cpus_per_gpu=2.0)
    assert not spec.phases[0].device_decode and spec.events[-1]["on"] == "object_store"


def test_cpu_decode_rate_times_the_cpu_path_on_a_sample_of_the_tier(jpeg_manifest, tmp_path):
    from lightray.data import autotune

    spec = make_spec(jpeg_manifest, str(tmp_path / "local"), "cpu", cuda=False)
    sample = autotune.sample_encoded(spec, 0, n=8)
    assert len(sample) == 8 and all(d[:2] == b"\xff\xd8" and h > 0 and w > 0 for d, h, w, _ in sample)
    assert autotune.cpu_decode_rate(sample, RES, 0.25, spec.seed, seconds=0.1) > 0
    assert device_decode.decode_rate([d for d, _, _, _ in sample], "cpu", seconds=0.1) > 0


def test_gpu_e2e_reports_the_decode_path_each_phase_picked_and_blames_it_when_starved():
    from bench.gpu_e2e import decode_paths, run_args, starved_by

    assert "--data.decode_on=auto" in run_args(pathlib.Path("src"), pathlib.Path("w"), [(288, 128, 0.5)], 1, False,
                                               224)
    recs = [{"event": "unit", "unit": "decode_on", "phase": 2, "on": "device", "cpu_img_s_per_cpu": 310.0,
             "device_img_s": 9000.0, "cpus_per_gpu": 15.0, "message": "phase 2 (288px): nvJPEG"},
            {"event": "unit", "unit": "decode_on", "phases": [2], "on": "device", "message": "worker line"},
            {"event": "unit", "unit": "augment_on", "phase": 0, "on": "device"}]
    got = decode_paths(recs)
    assert set(got) == {2} and got[2]["on"] == "device" and got[2]["device_img_s"] == 9000.0
    assert "decoded on the GPU" in starved_by(0.5, 0.4, 50.0, False, device_decode=True)


@pytest.mark.parametrize("fails_on", ["batch", "image"])
def test_running_out_of_device_memory_is_raised_not_dropped_as_a_damaged_image(monkeypatch, fails_on):
    import torchvision.io

    good = io.BytesIO()
    Image.new("RGB", (8, 6), (200, 10, 10)).save(good, "JPEG")
    data = device_decode.as_tensors([np.frombuffer(good.getvalue(), np.uint8)] * 3)
    real = torchvision.io.decode_jpeg

    def decode_jpeg(arg, **kw):
        # The device's allocator failing (injected: this machine has no GPU to fill), on the batched call or
        # on the image-by-image retry that follows a bad image.
        if fails_on == "batch" or not isinstance(arg, list):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        raise RuntimeError("Not a JPEG file")

    monkeypatch.setattr(torchvision.io, "decode_jpeg", decode_jpeg)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        device_decode.decode(data, "cpu")
    monkeypatch.setattr(torchvision.io, "decode_jpeg", real)
    images, bad = device_decode.decode(data, "cpu")  # the same bytes decode once memory is there
    assert bad == [] and [tuple(im.shape) for im in images] == [(3, 6, 8)] * 3
