"""Ray Data ingest per phase: plan units -> decode + crop + flip in Ray Data tasks -> uint8 batches.

How the pieces meet Ray Train:
- ``train_datasets()`` returns ``datasets=`` for the TorchTrainer: one entry per phase (``train_p0``,
  ``train_p1``, ...) and ``val``. Each value is a *function*; Ray Train calls it at every worker-group
  start, so each start builds the stream from the resume position chosen then (see
  ``app.train.state.select_resume``), not from sample zero.
- A dataset's rows are small "units" (epoch, first step, number of steps). ``PlanDataConfig.configure``
  is called with the number of workers and gives rank ``r`` the same units mapped by a function that
  produces exactly rank ``r``'s slice of each global batch (``app.data.plan``), in order
  (``preserve_order``). Decoding and augmentation run as Ray Data tasks anywhere in the cluster; the
  worker receives uint8 HWC batches and normalises on its device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import ray
import ray.data
import ray.train

from app.data import augment, shard_cache
from app.data.plan import EpochPlan, rank_slice

log = logging.getLogger(__name__)
UNIT_ROWS = 512  # global rows per unit: big enough to amortise task overhead, small for smooth streaming


@dataclass
class TierShards:
    tier: int
    fmt: str  # "jpeg" | "raw"
    uris: list[str]
    sha256: list[str]
    rows: list[int]


@dataclass
class PhaseSpec:
    index: int
    resolution: int
    batch_size: int
    min_scale: float
    first_epoch: int
    end_epoch: int  # exclusive
    shards: TierShards


@dataclass
class IngestSpec:
    """Everything a Ray Data task needs; picklable and small."""

    seed: int
    local_dir: str
    train_size: int
    phases: list[PhaseSpec]
    val: TierShards
    eval_resolution: int
    val_crop_ratio: float
    map_cpus: float = 0.25
    map_concurrency: int | None = None
    prefetch_batches: int = 2
    phase_units: dict = field(default_factory=dict)


def _fetch(shards: TierShards, local_dir: str, shard_idx: np.ndarray, rows: np.ndarray):
    """Decoded PIL images, labels and sample ids for (shard, row) pairs, in the given order."""
    images, labels, ids = [], [], []
    cols = ["image", "label", "sample_id", "height", "width"]
    for s, r in zip(shard_idx.tolist(), rows.tolist()):
        table = shard_cache.open_table(shards.uris[s], shards.sha256[s], local_dir, cols)
        rec = {c: table.column(c)[r].as_py() for c in cols}
        images.append(augment.decode(rec["image"], shards.fmt, rec["height"], rec["width"]))
        labels.append(rec["label"])
        ids.append(rec["sample_id"])
    return images, np.asarray(labels, dtype=np.int64), np.asarray(ids, dtype=np.int64)


def train_unit_batch(units: dict, *, spec: IngestSpec, phase: int, rank: int, world_size: int) -> dict:
    """Map one or more plan units to rank's images for those steps (Ray Data ``map_batches`` fn)."""
    ph = spec.phases[phase]
    plan = EpochPlan(ph.shards.rows, spec.seed)
    lo, hi = rank_slice(ph.batch_size, world_size, rank)
    out_img, out_lab, out_id, out_epoch = [], [], [], []
    for epoch, step0, nsteps in zip(units["epoch"].tolist(), units["step0"].tolist(), units["nsteps"].tolist()):
        order = plan.order(epoch)
        for step in range(step0, step0 + nsteps):
            glob = order[step * ph.batch_size + lo: step * ph.batch_size + hi]
            shard_idx, rows = plan.to_shard_row(glob)
            imgs, labels, ids = _fetch(ph.shards, spec.local_dir, shard_idx, rows)
            for img, sid in zip(imgs, ids.tolist()):
                out_img.append(augment.train_crop(img, ph.resolution, ph.min_scale,
                                                  augment.sample_rng(spec.seed, epoch, sid)))
            out_lab.append(labels)
            out_id.append(ids)
            out_epoch.append(np.full(len(ids), epoch, dtype=np.int64))
    if not out_img:  # the placeholder unit of a phase that is already trained
        return {"image": np.zeros((0, ph.resolution, ph.resolution, 3), np.uint8), "label": np.zeros(0, np.int64),
                "sample_id": np.zeros(0, np.int64), "epoch": np.zeros(0, np.int64)}
    return {"image": np.stack(out_img), "label": np.concatenate(out_lab), "sample_id": np.concatenate(out_id),
            "epoch": np.concatenate(out_epoch)}


def val_unit_batch(units: dict, *, spec: IngestSpec, rank: int, world_size: int, resolution: int) -> dict:
    plan_rows = np.asarray(spec.val.rows)
    offsets = np.concatenate([[0], np.cumsum(plan_rows)])
    out_img, out_lab, out_id = [], [], []
    for start, end in zip(units["start"].tolist(), units["end"].tolist()):
        glob = np.arange(start, end)
        glob = glob[glob % world_size == rank]
        if len(glob) == 0:
            continue
        shard_idx = np.searchsorted(offsets, glob, side="right") - 1
        imgs, labels, ids = _fetch(spec.val, spec.local_dir, shard_idx, glob - offsets[shard_idx])
        out_img += [augment.center_crop(img, resolution, spec.val_crop_ratio) for img in imgs]
        out_lab.append(labels)
        out_id.append(ids)
    if not out_img:
        return {"image": np.zeros((0, resolution, resolution, 3), np.uint8), "label": np.zeros(0, np.int64),
                "sample_id": np.zeros(0, np.int64)}
    return {"image": np.stack(out_img), "label": np.concatenate(out_lab), "sample_id": np.concatenate(out_id)}


def phase_units(spec: IngestSpec, phase: int, start_epoch: int, start_step: int) -> list[dict]:
    """The units of ``phase`` from the resume position (epoch, step) on, in training order."""
    ph = spec.phases[phase]
    steps_per_epoch = spec.train_size // ph.batch_size
    per_unit = max(1, UNIT_ROWS // ph.batch_size)
    units = []
    for epoch in range(max(ph.first_epoch, start_epoch), ph.end_epoch):
        first = start_step if epoch == start_epoch else 0
        for s in range(first, steps_per_epoch, per_unit):
            units.append({"epoch": epoch, "step0": s, "nsteps": min(per_unit, steps_per_epoch - s)})
    return units


def make_units_dataset(units: list[dict]) -> ray.data.Dataset:
    if not units:
        units = [{"epoch": -1, "step0": 0, "nsteps": 0}]  # an empty phase (already trained): mapped to nothing
    return ray.data.from_items(units, override_num_blocks=len(units))


def val_units(spec: IngestSpec) -> list[dict]:
    n = sum(spec.val.rows)
    return [{"start": s, "end": min(n, s + UNIT_ROWS)} for s in range(0, n, UNIT_ROWS)]


class PlanDataConfig(ray.train.DataConfig):
    """Gives each rank its own ordered stream of its slice of every global batch."""

    def __init__(self, spec: IngestSpec):
        super().__init__(datasets_to_split=[])
        self.spec = spec

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        from ray.data import ExecutionOptions
        from ray.data.context import DataContext

        ctx = DataContext.get_current()
        options = ExecutionOptions(resource_limits=ctx.execution_options.resource_limits, preserve_order=True)
        out = [{} for _ in range(world_size)]
        for name, ds in datasets.items():
            for rank in range(world_size):
                if name.startswith("train_p"):
                    phase = int(name.removeprefix("train_p"))
                    mapped = ds.map_batches(
                        train_unit_batch, batch_size=1, batch_format="numpy", num_cpus=self.spec.map_cpus,
                        concurrency=self.spec.map_concurrency,
                        fn_kwargs={"spec": self.spec, "phase": phase, "rank": rank, "world_size": world_size})
                elif name == "val":
                    mapped = ds.map_batches(
                        val_unit_batch, batch_size=1, batch_format="numpy", num_cpus=self.spec.map_cpus,
                        concurrency=self.spec.map_concurrency,
                        fn_kwargs={"spec": self.spec, "rank": rank, "world_size": world_size,
                                   "resolution": self.spec.eval_resolution})
                else:
                    mapped = ds
                mapped.context.execution_options = options
                out[rank][name] = mapped.iterator()
        return out
