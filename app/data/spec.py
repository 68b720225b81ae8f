"""What a Ray Data preprocessing task needs to know (``IngestSpec``) and its parts: the stored tier each
phase reads, and the defaults of the preprocessing knobs. Shared by the ingest and by the preprocessing
calibration (``lightray.data.autotune``), which both read images through ``TierShards.images``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from lightray.data import shard_cache

log = logging.getLogger("lightray.data.ingest")  # the events are the ingest's: logged under its name
BLOCK_ROWS = 512  # default global rows per plan block: amortises task overhead, small enough for smooth streaming
MAP_CPUS = 0.25  # default CPUs a map task reserves: fractional, so Data tasks never starve Train (ray#44687)


@dataclass
class TierShards:
    tier: int
    fmt: str  # "jpeg" | "raw"
    uris: list[str]
    sha256: list[str]
    rows: list[int]
    refs: list | None = None  # object-store level: one DecodedShard ref per shard (None = read from disk)

    @property
    def level(self) -> str:
        return "object_store" if self.refs is not None else "local_disk"

    def shard(self, index: int, local_dir: str, max_bytes: int = 0) -> shard_cache.ShardView:
        """Shard ``index`` at this tier; ``max_bytes`` > 0 bounds the node-local copies (see shard_cache)."""
        if self.refs is not None:
            return shard_cache.object_store_shard(self.refs[index])
        return shard_cache.parquet_shard(self.uris[index], self.sha256[index], self.fmt, local_dir, max_bytes)

    def meta(self, local_dir: str, shard_idx: np.ndarray, rows: np.ndarray,
             max_bytes: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(heights, widths, labels, sample ids) of (shard, row) pairs as int64 arrays, gathered a shard at a time
        from its columns: no image is read."""
        shard_idx, rows = np.asarray(shard_idx, np.int64), np.asarray(rows, np.int64)
        out = np.zeros((4, len(rows)), np.int64)
        for at in by_shard(shard_idx):
            view, r = self.shard(int(shard_idx[at[0]]), local_dir, max_bytes), rows[at]
            out[:, at] = view.heights[r], view.widths[r], view.labels[r], view.ids[r]
        return out[0], out[1], out[2], out[3]

    def square_pixels(self, local_dir: str, shard_idx: np.ndarray, rows: np.ndarray, size: int,
                      max_bytes: int = 0) -> np.ndarray | None:
        """The (n, size, size, 3) pixels of (shard, row) pairs in the given order, gathered a shard at a time by
        one fancy index, where every shard read holds its rows as ``size`` x ``size`` pixels back to back (raw
        or decoded: :meth:`ShardView.square_rows`); None where one does not (JPEG rows, mixed sizes)."""
        shard_idx, rows = np.asarray(shard_idx, np.int64), np.asarray(rows, np.int64)
        out = np.empty((len(rows), size, size, 3), np.uint8)
        for at in by_shard(shard_idx):
            view = self.shard(int(shard_idx[at[0]]), local_dir, max_bytes).square_rows(size)
            if view is None:
                return None
            out[at] = view[rows[at]]
        return out

    def images(self, local_dir: str, shard_idx: np.ndarray, rows: np.ndarray,
               max_bytes: int = 0) -> Iterator[tuple[Image.Image, int, int]]:
        """(PIL image, label, sample id) for (shard, row) pairs, in the given order."""
        for s, r in zip(shard_idx.tolist(), rows.tolist()):
            view = self.shard(s, local_dir, max_bytes)
            yield view.image(r), int(view.labels[r]), int(view.ids[r])

    def encoded(self, local_dir: str, shard_idx: np.ndarray, rows: np.ndarray,
                max_bytes: int = 0) -> Iterator[tuple[bytes, int, int, int, int]]:
        """(stored bytes, height, width, label, sample id) for (shard, row) pairs: no decode (device decode)."""
        for s, r in zip(shard_idx.tolist(), rows.tolist()):
            view = self.shard(s, local_dir, max_bytes)
            yield (view.encoded(r), int(view.heights[r]), int(view.widths[r]), int(view.labels[r]),
                   int(view.ids[r]))

    def arrays(self, local_dir: str, shard_idx: np.ndarray, rows: np.ndarray,
               max_bytes: int = 0) -> Iterator[tuple[np.ndarray, int, int]]:
        """(HWC uint8 pixels, label, sample id) for (shard, row) pairs; a view without a copy for raw tiers."""
        for s, r in zip(shard_idx.tolist(), rows.tolist()):
            view = self.shard(s, local_dir, max_bytes)
            yield view.pixels(r), int(view.labels[r]), int(view.ids[r])


def by_shard(shard_idx: np.ndarray) -> list[np.ndarray]:
    """Positions into ``shard_idx`` grouped by shard (each group in its original order), so a shard is opened
    once per group."""
    order = np.argsort(shard_idx, kind="stable")
    return np.split(order, np.flatnonzero(np.diff(shard_idx[order])) + 1) if len(order) else []


@dataclass
class PhaseSpec:
    index: int
    resolution: int
    batch_size: int
    min_scale: float
    first_epoch: int
    end_epoch: int  # exclusive
    shards: TierShards
    # Device augmentation (raw tiers): tasks ship each sample's window of stored pixels on a fixed canvas, with
    # its crop box and flip bit; the worker crops, resizes and flips the batch on its device.
    device_augment: bool = False
    canvas: tuple[int, int] = (0, 0)  # (h, w) of every shipped image when device_augment
    # Device decode (JPEG tiers read from disk): tasks ship each sample's JPEG bytes, crop box and flip bit; the
    # worker decodes the batch on its device (decode_jpeg), then crops it as device augmentation does.
    device_decode: bool = False
    # data.decode_on=auto on GPU workers: the driver's measurements ({"cpu_img_s_per_cpu", "device_img_s" (None
    # when no GPU was up to time it on), "model_img_s"}); each worker-group start decides device_decode again
    # from them and the group it got (app/data/start_decode.py). None: the driver's choice holds for the run.
    decode_rates: dict[str, float | None] | None = None


@dataclass
class IngestSpec:
    """Everything a Ray Data task needs; picklable and small (object-store data travels as refs)."""

    seed: int
    local_dir: str
    train_size: int
    phases: list[PhaseSpec]
    val: TierShards
    eval_resolution: int
    val_crop_ratio: float
    map_cpus: float = MAP_CPUS
    flip: str = "random"  # data.flip: each sample's own coin per epoch, or alternating (augment.choose_flips)
    local_max_bytes: int = 0  # disk budget of the node-local shard copies (data.local_cache_max_gb); 0 = none
    map_concurrency: int | None = None  # tasks in flight, all ranks together; None = Ray Data's default
    # The CPUs Ray Data had when map_concurrency was calibrated (None: pinned by the config, or not calibrated):
    # each worker-group start scales the concurrency to the CPUs it leaves Ray Data (data_share.start_concurrency).
    map_concurrency_cpus: float | None = None
    calibration_seconds: float = 0.0  # data.autotune_seconds: a start with far more or fewer CPUs times again
    prefetch_batches: int = 2
    augment_on: str = "cpu"  # resolved data.augment_on: where training crops run ("cpu" | "device")
    block_rows: int = BLOCK_ROWS
    val_mode: str = "center"
    val_order: np.ndarray | None = None  # rect: val rows (global index) sorted by aspect ratio
    val_batches: list[dict] = field(default_factory=list)  # rect: {start, end, width, height} into val_order
    events: list[dict] = field(default_factory=list)  # unit events (data_cache, preprocess_autotune) to log
    # report.eval_sweep: resolution -> a copy of this spec whose validation runs at that resolution
    sweep: dict[int, IngestSpec] = field(default_factory=dict)

    @property
    def decode_on(self) -> str:
        """Where JPEG tiers are decoded, as resolved per phase by ``plan_decode``: "device" if any phase is."""
        return "device" if any(ph.device_decode for ph in self.phases) else "cpu"

    def event(self, unit: str, message: str, **fields: Any) -> None:
        log.info("%s: %s", unit, message)
        self.events.append({"unit": unit, "message": message, **fields})


def rank_task_share(tasks: int | None, world_size: int) -> int | None:
    """A rank's share of a start's map tasks in flight (``tasks`` for all ranks; None = Ray Data picks): the
    size of each rank's stream's task pool, and what ``scaling.warm_data_workers`` warms at most."""
    return max(1, math.ceil(tasks / world_size)) if tasks else None


def tier_shards(manifest: Any, split: str, want: int) -> TierShards:
    """The smallest stored tier of ``split`` at or above ``want`` px (else the largest) as a TierShards."""
    tier = manifest.tier_for(split, want)
    shards = manifest.shards(split, tier)
    return TierShards(tier, manifest.format(split, tier), [s.uri for s in shards], [s.sha256 for s in shards],
                      [s.rows for s in shards])
