"""What a Ray Data training task makes of a run of plan positions (epoch, shard, row): the sample's draws for the
whole run at once (:func:`lightray.data.augment.draw_crops`), then the path's per-sample work.

- CPU path: decode + PIL crop/resize + flip, written into one preallocated uint8 batch (where every crop is the
  whole photo at its stored size and the shards hold the pixels, a gather and a mirror, without PIL).
- Device augmentation (raw tier): each sample's window of stored pixels on the phase's canvas, its box in canvas
  pixels and its flip bit; the worker crops the batch on its device.
- Device decode (JPEG tier): each sample's stored JPEG bytes, box and flip; the worker decodes and crops.

The ingest's map (``lightray.data.ingest.train_block_batch``) and the preprocessing calibration
(``lightray.data.autotune``) both call :func:`positions_batch`, so the calibration times the work a run does.
"""

from __future__ import annotations

import numpy as np

from lightray.data import augment
from lightray.data.spec import IngestSpec, PhaseSpec


def positions_batch(spec: IngestSpec, phase: int, epochs: np.ndarray, shard_idx: np.ndarray,
                    rows: np.ndarray) -> dict:
    """The batch of these plan positions of ``phase`` (epochs, shard indices and rows: equal-length arrays)."""
    ph = spec.phases[phase]
    if ph.device_augment:
        return device_batch(spec, ph, epochs, shard_idx, rows)
    if ph.device_decode:
        return jpeg_batch(spec, ph, epochs, shard_idx, rows)
    return cpu_batch(spec, ph, epochs, shard_idx, rows)


def cpu_batch(spec: IngestSpec, ph: PhaseSpec, epochs: np.ndarray, shard_idx: np.ndarray, rows: np.ndarray) -> dict:
    """The CPU path: every sample decoded, cropped, resized and flipped here, into one (n, R, R, 3) batch."""
    heights, widths, labels, ids = ph.shards.meta(spec.local_dir, shard_idx, rows, spec.local_max_bytes)
    boxes, flips = augment.draw_crops(spec.seed, epochs, ids, heights, widths, ph.min_scale, spec.flip)
    if augment.copies_whole(boxes, heights, widths, ph.resolution).all():
        out = whole_photos(spec, ph, shard_idx, rows, flips)
    else:
        out = np.empty((len(ids), ph.resolution, ph.resolution, 3), np.uint8)
        for i, (img, _label, _sid) in enumerate(ph.shards.images(spec.local_dir, shard_idx, rows,
                                                                 spec.local_max_bytes)):
            out[i] = augment.train_crop(img, ph.resolution, boxes[i], bool(flips[i]))
    return {"image": out, "label": labels, "sample_id": ids, "epoch": np.asarray(epochs, np.int64)}


def whole_photos(spec: IngestSpec, ph: PhaseSpec, shard_idx: np.ndarray, rows: np.ndarray,
                 flips: np.ndarray) -> np.ndarray:
    """Where every crop is the whole photo at its stored size, the stored pixels mirrored: what train_crop gives
    (PIL's resize of that box is a copy), without a PIL image per sample. Raw or decoded shards of equal photos
    give one gather per shard and one mirror per block; JPEG rows a decode per sample."""
    out = ph.shards.square_pixels(spec.local_dir, shard_idx, rows, ph.resolution, spec.local_max_bytes)
    if out is not None:
        # Mirrored a pixel (3 bytes) at a time: a byte-wise reversed copy of HWC uint8 costs twice as much.
        pixels, at = out.view(np.dtype((np.void, 3)))[..., 0], np.flatnonzero(flips)
        pixels[at] = pixels[at, :, ::-1]
        return out
    out = np.empty((len(rows), ph.resolution, ph.resolution, 3), np.uint8)
    for i, (px, _label, _sid) in enumerate(ph.shards.arrays(spec.local_dir, shard_idx, rows, spec.local_max_bytes)):
        out[i] = px[:, ::-1] if flips[i] else px
    return out


def device_batch(spec: IngestSpec, ph: PhaseSpec, epochs: np.ndarray, shard_idx: np.ndarray,
                 rows: np.ndarray) -> dict:
    """Device augmentation: each sample's window of stored pixels on the phase's canvas, its crop box (in canvas
    pixels) and flip bit; the per-sample work here is a copy."""
    found = list(ph.shards.arrays(spec.local_dir, shard_idx, rows, spec.local_max_bytes))
    pixels = [px for px, _label, _sid in found]  # views into the shards: nothing copied yet
    labels = np.fromiter((label for _px, label, _sid in found), np.int64, len(found))
    ids = np.fromiter((sid for _px, _label, sid in found), np.int64, len(found))
    epochs = np.asarray(epochs, np.int64)
    images, boxes, flips = augment.device_windows(pixels, spec.seed, epochs, ids, ph.min_scale, ph.canvas,
                                                  spec.flip)
    return {"image": images, "box": boxes, "flip": flips, "label": labels, "sample_id": ids, "epoch": epochs}


def jpeg_batch(spec: IngestSpec, ph: PhaseSpec, epochs: np.ndarray, shard_idx: np.ndarray, rows: np.ndarray) -> dict:
    """Device decode: each sample's stored JPEG bytes, untouched, with its crop box (in stored-image pixels) and
    flip bit."""
    heights, widths, labels, ids = ph.shards.meta(spec.local_dir, shard_idx, rows, spec.local_max_bytes)
    boxes, flips = augment.draw_crops(spec.seed, epochs, ids, heights, widths, ph.min_scale, spec.flip)
    jpeg = np.empty(len(ids), dtype=object)
    for i, (data, _h, _w, _label, _sid) in enumerate(ph.shards.encoded(spec.local_dir, shard_idx, rows,
                                                                       spec.local_max_bytes)):
        jpeg[i] = data
    return {"jpeg": jpeg, "box": boxes.astype(np.float32), "flip": flips, "label": labels, "sample_id": ids,
            "epoch": np.asarray(epochs, np.int64)}
