"""The device paths' canvases are bounded by the crop's aspect limit: a crop box's aspect is within [3/4, 4/3], so
the window each sample ships (device augmentation) or pastes (device decode) is at most about the image's short
side * 4/3 in each direction, and a batch holding a few panoramas (288 x 2000) gets a canvas of about 389 x 389,
not one near their whole size. Checked on real prepared shards and real JPEGs, with the crops still those of the
whole images (float tolerance) and of the CPU path's PIL crops; the vectorised window copy gives crop_window's
canvases byte for byte."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from lightray.data import augment, autotune, device_decode
from lightray.data.ingest import IngestSpec, PhaseSpec, phase_blocks, plan_augmentation, tier_shards, train_block_batch
from lightray.data.manifest import Manifest
from lightray.data.prepare import prepare
from lightray.train import device as dev
from tests.conftest import start_session_ray
from tests.crops import draw_crop

TIER = 64  # the prepared tier's short side; the end-to-end test's panoramas are 64 x 440
RES = 48
SEED = 5
# (h, w) of the sources: normal shapes and extreme ones both ways (prepare keeps the aspect; short side 64)
SHAPES = [(64, 85), (85, 64), (64, 64), (72, 96), (64, 440), (440, 64), (64, 300), (300, 64)]
BIG = [(288, 2000), (2000, 288), (288, 384), (384, 288), (288, 288), (288, 1200), (1200, 288), (320, 288)]


def smooth_image(h: int, w: int, seed: int) -> np.ndarray:
    """HWC uint8 with gradients, low-frequency waves and a few discs: something a JPEG keeps and both crops
    (PIL's antialiased resize, roi_align's averaging) agree on."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    chans = []
    for c in range(3):
        fx, fy = rng.uniform(2, 6, 2) * 2 * np.pi
        v = 90 + 60 * np.sin(fx * x / w + c) * np.cos(fy * y / h) + 50 * (x / w) + 40 * (y / h)
        chans.append(v)
    img = np.stack(chans, axis=-1)
    for _ in range(6):
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(0.1, 0.3) * min(h, w)
        img[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.uniform(20, 235, 3)
    return np.clip(img, 0, 255).astype(np.uint8)


def jpeg_bytes(h: int, w: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(smooth_image(h, w, seed)).save(buf, "JPEG", quality=92)
    return buf.getvalue()


def whole_image_crop(pixels: np.ndarray, box: np.ndarray, flip: bool, size: int) -> np.ndarray:
    """The crop as the device paths made it before windows: the whole image on its own canvas with its last row
    and column repeated once, the box in the image's pixels (float32, as shipped)."""
    h, w = pixels.shape[:2]
    canvas = np.zeros((1, h + 1, w + 1, 3), np.uint8)
    canvas[0, :h, :w] = pixels
    canvas[0, :h, w] = pixels[:, w - 1]
    canvas[0, h, :w + 1] = canvas[0, h - 1, :w + 1]
    out = dev.crop_resize_flip(torch.from_numpy(canvas), torch.from_numpy(np.asarray([box], np.float32)),
                               torch.tensor([flip]), size)
    return out[0].permute(1, 2, 0).numpy().astype(np.float64)


def side_limit(short: int) -> int:
    """The canvas side an image of this short side may need: its short side * 4/3, the window's margin, the
    edge copy's row or column."""
    return math.ceil(short * 4 / 3) + augment.WINDOW_MARGIN + 1


def test_canvas_for_a_tier_with_panoramas_is_bounded_by_the_short_side_times_four_thirds():
    heights = np.array([h for h, _ in BIG] * 8)
    widths = np.array([w for _, w in BIG] * 8)
    ch, cw = augment.canvas_for(heights, widths)
    # sqrt(288 * 2000 * 4/3) is 876: the old bound made this tier's canvas 882 x 882, 3 GB as float32 at 256
    assert ch <= side_limit(288) and cw <= side_limit(288), (ch, cw)
    assert (ch, cw) == (side_limit(288), side_limit(288))  # the 4:3 and panorama images do need that much
    for h, w in BIG:
        bh, bw = augment.window_bound(h, w)
        assert bh + 1 <= ch and bw + 1 <= cw and bh <= h and bw <= w


@pytest.mark.parametrize("min_scale", [0.08, 0.35, 1.0])
def test_every_drawn_window_fits_the_bound_including_crop_box_fallbacks(min_scale):
    rng = np.random.default_rng(0)
    sizes = [(h, w) for h, w in BIG] + [(int(a), int(b)) for a, b in rng.integers(1, 700, (60, 2))]
    sizes += [(1, 1), (1, 500), (500, 1), (3, 4), (4, 3), (2, 9)]
    fallbacks = 0
    for k, (h, w) in enumerate(sizes):
        for sid in range(25):
            box, _ = draw_crop(SEED, k, sid, w, h, min_scale)
            x0, y0, x1, y1 = box
            fallbacks += math.isclose(x1 - x0, min(w, h * 4 / 3)) and math.isclose(y1 - y0, min(h, w * 4 / 3))
            win = augment.window_boxes(np.array([box]), np.array([h]), np.array([w]))[0]
            bh, bw = augment.window_bound(h, w)
            assert win[3] - win[1] <= bh and win[2] - win[0] <= bw, (h, w, box, win)
            assert 3 / 4 - 1e-9 <= (x1 - x0) / (y1 - y0) <= 4 / 3 + 1e-9  # the aspect limit the bound uses
    if min_scale == 1.0:
        assert fallbacks > 0  # torchvision's fallback box (no try fits) was met and bounded too


def test_vectorised_window_copy_gives_crop_windows_canvases_and_boxes_byte_for_byte():
    rng = np.random.default_rng(1)
    shapes = BIG[:4] + [(int(a), int(b)) for a, b in rng.integers(2, 120, (30, 2))] + [(1, 1), (2, 700)]
    pixels = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in shapes]
    canvas = augment.canvas_for(np.array([h for h, _ in shapes]), np.array([w for _, w in shapes]))
    ids = np.arange(len(shapes), dtype=np.int64) + 100
    epochs = np.arange(len(shapes), dtype=np.int64) % 3
    images, boxes, flips = augment.device_windows(pixels, SEED, epochs, ids, 0.25, canvas)
    assert images.shape == (len(shapes), *canvas, 3)
    for i, px in enumerate(pixels):
        box, flip = draw_crop(SEED, int(epochs[i]), int(ids[i]), px.shape[1],
                                      px.shape[0], 0.25)
        ref = np.zeros((*canvas, 3), np.uint8)
        ref_box = augment.crop_window(px, box, ref)
        assert np.array_equal(images[i], ref), i
        assert np.array_equal(boxes[i], ref_box) and bool(flips[i]) == flip, i
    assert 0 < flips.sum() < len(flips)


@pytest.fixture(scope="module")
def panorama_manifest(tmp_path_factory) -> Manifest:

    root = tmp_path_factory.mktemp("canvas")
    seed = 0
    for split, per_class in (("train", SHAPES), ("val", SHAPES[:1])):
        for label in ("a", "b"):
            (root / "src" / split / label).mkdir(parents=True)
            for i, (h, w) in enumerate(per_class):
                seed += 1
                Image.fromarray(smooth_image(h, w, seed)).save(root / "src" / split / label / f"{i}.jpg", quality=92)
    start_session_ray()
    yield Manifest.load(str(prepare(str(root / "src"), str(root / "cache"), [TIER], raw_max_resolution=TIER,
                                    shard_rows=16)))


def test_device_augment_canvas_with_panoramas_stays_small_and_crops_match(panorama_manifest, tmp_path):
    m = panorama_manifest
    spec = IngestSpec(seed=SEED, local_dir=str(tmp_path / "local"), train_size=m.num_samples("train"),
                      phases=[PhaseSpec(0, RES, 16, 0.25, 0, 2, tier_shards(m, "train", TIER))],
                      val=tier_shards(m, "val", TIER), eval_resolution=RES, val_crop_ratio=0.875)
    plan_augmentation(spec, "device", False)
    ph = spec.phases[0]
    assert ph.device_augment and ph.shards.fmt == "raw"
    blocks = {k: np.array([b[k] for b in phase_blocks(spec, 0, 0, 0)]) for k in ("epoch", "step0", "nsteps")}
    got = train_block_batch(blocks, spec=spec, phase=0, rank=0, world_size=1)
    stored = {}
    for e in (0, 1):
        for px, _lab, sid in ph.shards.arrays(spec.local_dir, *tier_rows(spec, e)):
            stored[sid] = np.array(px)
    assert {tuple(p.shape[:2]) for p in stored.values()} >= {(64, 440), (440, 64)}  # the panoramas are there
    assert ph.canvas[0] <= side_limit(TIER) and ph.canvas[1] <= side_limit(TIER), ph.canvas  # not 199 x 199
    assert got["image"].shape[1:3] == ph.canvas
    # the calibration times this same task work (draws, then the block's window copies): it runs on the tier
    assert autotune._calibration_task(spec, 0, 0, 20) == 20

    crops = dev.crop_resize_flip(torch.from_numpy(got["image"]), torch.from_numpy(got["box"]),
                                 torch.from_numpy(got["flip"]), RES).permute(0, 2, 3, 1).numpy().astype(np.float64)
    for i, (sid, epoch) in enumerate(zip(got["sample_id"].tolist(), got["epoch"].tolist())):
        px = stored[sid]
        box, flip = draw_crop(SEED, epoch, sid, px.shape[1], px.shape[0], ph.min_scale)
        assert bool(got["flip"][i]) == flip
        whole = whole_image_crop(px, np.asarray(box, np.float32), flip, RES)
        assert np.abs(crops[i] - whole).max() < 0.05, (sid, np.abs(crops[i] - whole).max())

    ph.device_augment = False  # the CPU path (PIL crops in the task) over the very same blocks
    cpu = train_block_batch(blocks, spec=spec, phase=0, rank=0, world_size=1)
    assert (cpu["sample_id"] == got["sample_id"]).all() and (cpu["label"] == got["label"]).all()
    err = np.abs(crops.round().clip(0, 255) - cpu["image"].astype(np.float64)).mean(axis=(1, 2, 3))
    assert err.mean() < 6.0 and err.max() < 12.0, (err.mean(), err.max())


def tier_rows(spec: IngestSpec, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    from lightray.data.plan import EpochPlan

    plan = EpochPlan(spec.phases[0].shards.rows, spec.seed)
    return plan.to_shard_row(plan.order(epoch))


def decode_batch_of(shapes: list[tuple[int, int]], min_scale: float = 0.25) -> tuple[dict, list[np.ndarray]]:
    """A device-decode batch of real JPEGs of these (h, w), boxes and flips drawn as jpeg_block_batch draws them,
    and the pixels decode_jpeg gives for each (the CPU device's libjpeg-turbo)."""
    jpeg = np.empty(len(shapes), dtype=object)
    boxes = np.zeros((len(shapes), 4), np.float32)
    flips = np.zeros(len(shapes), bool)
    for i, (h, w) in enumerate(shapes):
        jpeg[i] = np.frombuffer(jpeg_bytes(h, w, 40 + i), np.uint8)
        box, flips[i] = draw_crop(SEED, 0, i, w, h, min_scale)
        boxes[i] = box
    decoded, bad = device_decode.decode(device_decode.as_tensors(jpeg), "cpu")
    assert not bad
    pixels = [im.permute(1, 2, 0).numpy() for im in decoded]
    return {"jpeg": jpeg, "box": boxes, "flip": flips, "sample_id": np.arange(len(shapes))}, pixels


@pytest.mark.parametrize("min_scale", [0.25, 1.0])
def test_device_decode_pastes_windows_so_panoramas_no_longer_size_the_canvas(min_scale):
    batch, pixels = decode_batch_of(BIG, min_scale)
    d = device_decode.decode_batch(batch, "cpu")
    n, ch, cw, c = d.canvas.shape
    assert (n, c) == (len(BIG), 3)
    assert ch <= side_limit(288) and cw <= side_limit(288), (ch, cw)  # the whole images made it 2001 x 2001
    size = 112
    crops = dev.crop_resize_flip(d.canvas, d.boxes, d.flips, size).permute(0, 2, 3, 1).numpy().astype(np.float64)
    for i, px in enumerate(pixels):
        whole = whole_image_crop(px, batch["box"][i], bool(batch["flip"][i]), size)
        assert np.abs(crops[i] - whole).max() < 0.05, (BIG[i], np.abs(crops[i] - whole).max())
        # the CPU path: PIL's decode and crop of the same bytes from the same draws
        img = augment.decode(bytes(batch["jpeg"][i]), "jpeg", *BIG[i])
        box, flip = draw_crop(SEED, 0, i, BIG[i][1], BIG[i][0], min_scale)
        cpu = augment.train_crop(img, size, box, flip).astype(np.float64)
        err = np.abs(crops[i].round().clip(0, 255) - cpu).mean()
        assert err < 6.0, (BIG[i], err)


def test_paste_repeats_each_windows_last_row_and_column_past_it():
    rng = np.random.default_rng(2)
    images = [torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8)) for h, w in [(5, 9), (7, 4), (6, 6)]]
    windows = np.array([[2, 1, 7, 4], [0, 0, 4, 7], [1, 3, 6, 6]], np.int64)
    canvas = device_decode.paste(images, windows, "cpu")
    assert tuple(canvas.shape) == (3, 3, 8, 6)  # the largest window (7 x 5) plus the edge row and column
    for im, (x0, y0, x1, y1), got in zip(images, windows.tolist(), canvas):
        win = im[:, y0:y1, x0:x1]
        assert torch.equal(got[:, :y1 - y0, :x1 - x0], win)
        assert torch.equal(got[:, :y1 - y0, x1 - x0:], win[:, :, -1:].expand(-1, -1, 6 - (x1 - x0)))
        assert torch.equal(got[:, y1 - y0:, :], got[:, y1 - y0 - 1:y1 - y0, :].expand(-1, 8 - (y1 - y0), -1))
    whole = device_decode.paste(images, None, "cpu")  # whole images: what the decode rate times
    assert tuple(whole.shape) == (3, 3, 8, 10) and torch.equal(whole[0, :, :5, :9], images[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (nvJPEG, pinned copies)")
def test_device_decode_on_cuda_gives_the_cpu_devices_windows_and_boxes():
    batch, _ = decode_batch_of(BIG)
    on_cpu = device_decode.decode_batch(batch, "cpu")
    on_gpu = device_decode.decode_batch(batch, "cuda")
    assert on_gpu.canvas.shape == on_cpu.canvas.shape and on_gpu.canvas.is_cuda
    assert torch.equal(on_gpu.boxes.cpu(), on_cpu.boxes) and torch.equal(on_gpu.flips.cpu(), on_cpu.flips)
    diff = (on_gpu.canvas.cpu().float() - on_cpu.canvas.float()).abs().mean()
    assert diff < 3.0, diff  # nvJPEG and libjpeg-turbo differ by rounding, not by placement

