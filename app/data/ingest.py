"""Ray Data ingest per phase: plan blocks -> decode + crop + flip in Ray Data tasks -> uint8 batches.

How the pieces meet Ray Train:
- ``train_datasets()`` returns ``datasets=`` for the TorchTrainer: one entry per phase (``train_p0``,
  ``train_p1``, ...) and ``val``. Each value is a *function*; Ray Train calls it at every worker-group
  start, so each start builds the stream from the resume position chosen then (see
  ``lightray.train.state.select_resume``), not from sample zero.
- A dataset's rows are small "blocks" (epoch, first step, number of steps). ``PlanDataConfig.configure``
  is called with the number of workers and gives rank ``r`` the same blocks mapped by a function that
  produces exactly rank ``r``'s slice of each global batch (``lightray.data.plan``), in order
  (``preserve_order``). Decoding and augmentation run as Ray Data tasks anywhere in the cluster; the
  worker receives uint8 HWC batches and normalises on its device. With device augmentation (a raw tier,
  ``data.augment_on``) the tasks only copy each sample's window of stored pixels and ship its crop box and
  flip bit; the worker crops, resizes and flips the batch in one op (:func:`plan_augmentation`).
- Where the pixels come from (``lightray.data.shard_cache``): a tier that fits ``data.memory_budget_mb``
  decoded is materialized in the object store at start (:func:`materialize_tiers`); the others are read
  from the node-local copy of each shard. ``IngestSpec.events`` says which level serves each phase.
- Validation: ``val_mode=center`` scores square centre crops; ``val_mode=rect`` sorts the split by aspect
  ratio, cuts it into batches of neighbours and resizes each batch to one rectangle near its aspect
  (:func:`plan_rect_validation`); each batch is split across ranks, so each rank's blocks stay uniform.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import ray.data
import ray.train

from lightray import units
from lightray.data import augment, autotune, data_share, shard_cache, start_decode, task_batches
from lightray.data.plan import EpochPlan, rank_slice
from lightray.data.spec import BLOCK_ROWS, IngestSpec, TierShards, rank_task_share

# The spec and its parts stay importable from the ingest, whose public types they are ("X as X": re-exported).
from lightray.data.spec import MAP_CPUS as MAP_CPUS
from lightray.data.spec import PhaseSpec as PhaseSpec
from lightray.data.spec import tier_shards as tier_shards


def train_block_batch(blocks: dict, *, spec: IngestSpec, phase: int, rank: int, world_size: int) -> dict:
    """Map one or more plan blocks to rank's images for those steps (Ray Data ``map_batches`` fn)."""
    # The placeholder block of a phase already trained has no positions: every path makes an empty batch of it.
    return task_batches.positions_batch(spec, phase, *rank_positions(blocks, spec, phase, rank, world_size))


def rank_positions(blocks: dict, spec: IngestSpec, phase: int, rank: int,
                   world_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(epochs, shard indices, rows) of rank's slice of every step of the blocks, in training order."""
    ph = spec.phases[phase]
    plan = EpochPlan(ph.shards.rows, spec.seed)
    lo, hi = rank_slice(ph.batch_size, world_size, rank)
    epochs, shards, rows = [], [], []
    for epoch, step0, nsteps in zip(blocks["epoch"].tolist(), blocks["step0"].tolist(), blocks["nsteps"].tolist()):
        order = plan.order(epoch)
        for step in range(step0, step0 + nsteps):
            shard_idx, r = plan.to_shard_row(order[step * ph.batch_size + lo: step * ph.batch_size + hi])
            epochs.append(np.full(len(r), epoch, np.int64))
            shards.append(np.asarray(shard_idx, np.int64))
            rows.append(np.asarray(r, np.int64))
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(epochs), np.concatenate(shards), np.concatenate(rows)


def val_block_batch(blocks: dict, *, spec: IngestSpec, rank: int, world_size: int, resolution: int) -> dict:
    """Rank's share of one validation block: every ``world_size``-th position of [start, end), resized to
    the block's ``width`` x ``height`` (square centre crop, or the rectangle of a rect batch)."""
    offsets = np.concatenate([[0], np.cumsum(np.asarray(spec.val.rows, dtype=np.int64))])
    out_img, out_lab, out_id = [], [], []
    width = height = resolution
    for start, end, width, height in zip(blocks["start"].tolist(), blocks["end"].tolist(), blocks["width"].tolist(),
                                         blocks["height"].tolist()):
        pos = np.arange(start + rank, end, world_size)
        glob = spec.val_order[pos] if spec.val_order is not None else pos
        if len(glob) == 0:
            continue
        shard_idx = np.searchsorted(offsets, glob, side="right") - 1
        rows = glob - offsets[shard_idx]
        for img, label, sid in spec.val.images(spec.local_dir, shard_idx, rows, spec.local_max_bytes):
            if spec.val_mode == "rect":
                out_img.append(augment.rect_crop(img, width, height))
            else:
                out_img.append(augment.center_crop(img, resolution, spec.val_crop_ratio))
            out_lab.append(label)
            out_id.append(sid)
    if not out_img:
        return {"image": np.zeros((0, height, width, 3), np.uint8), "label": np.zeros(0, np.int64),
                "sample_id": np.zeros(0, np.int64)}
    return {"image": np.stack(out_img), "label": np.asarray(out_lab, np.int64),
            "sample_id": np.asarray(out_id, np.int64)}


def phase_blocks(spec: IngestSpec, phase: int, start_epoch: int, start_step: int) -> list[dict]:
    """The blocks of ``phase`` from the resume position (epoch, step) on, in training order."""
    ph = spec.phases[phase]
    steps_per_epoch = spec.train_size // ph.batch_size
    per_block = max(1, spec.block_rows // ph.batch_size)
    blocks = []
    for epoch in range(max(ph.first_epoch, start_epoch), ph.end_epoch):
        first = start_step if epoch == start_epoch else 0
        for s in range(first, steps_per_epoch, per_block):
            blocks.append({"epoch": epoch, "step0": s, "nsteps": min(per_block, steps_per_epoch - s)})
    return blocks


def make_blocks_dataset(blocks: list[dict], placeholder: dict | None = None) -> ray.data.Dataset:
    if not blocks:  # an empty phase (already trained): one block that maps to nothing
        blocks = [placeholder or {"epoch": -1, "step0": 0, "nsteps": 0}]
    return ray.data.from_items(blocks, override_num_blocks=len(blocks))


def val_blocks(spec: IngestSpec) -> list[dict]:
    """Validation blocks: the rect batches, or runs of ``block_rows`` consecutive samples."""
    if spec.val_mode == "rect" and spec.val_batches:
        return [dict(b) for b in spec.val_batches]
    n = sum(spec.val.rows)
    r = spec.eval_resolution
    return [{"start": s, "end": min(n, s + spec.block_rows), "width": r, "height": r}
            for s in range(0, n, spec.block_rows)]


def val_dataset(spec: IngestSpec) -> ray.data.Dataset:
    r = spec.eval_resolution
    return make_blocks_dataset(val_blocks(spec), {"start": 0, "end": 0, "width": r, "height": r})


def plan_rect_validation(spec: IngestSpec, batch_size: int) -> None:
    """Sort the validation split by aspect ratio (w/h of the stored tier, which keeps the original's) and
    cut it into batches of ``batch_size`` neighbours, each resized to one rectangle near its mean aspect:
    much less of each image is cropped away than with a square centre crop (fast.ai, DAWNBench 2018)."""
    if not spec.val.uris:
        return
    hw = [shard_cache.read_columns(u, ["height", "width"]) for u in spec.val.uris]
    heights = np.concatenate([t.column("height").to_numpy() for t in hw]).astype(np.float64)
    widths = np.concatenate([t.column("width").to_numpy() for t in hw]).astype(np.float64)
    aspect = widths / heights
    order = np.argsort(aspect, kind="stable")
    batches = []
    for s in range(0, len(order), batch_size):
        e = min(len(order), s + batch_size)
        w, h = augment.rect_target(float(aspect[order[s:e]].mean()), spec.eval_resolution)
        batches.append({"start": s, "end": e, "width": w, "height": h})
    spec.val_mode, spec.val_order, spec.val_batches = "rect", order.astype(np.int64), batches
    shapes = sorted({(b["width"], b["height"]) for b in batches})
    spec.event("rect_val", f"rectangular validation: {len(order)} images sorted by aspect in {len(batches)} "
                           f"batches of {batch_size}; {len(shapes)} shapes from {shapes[0]} to {shapes[-1]} (w, h)",
               batches=len(batches), shapes=len(shapes))


def tier_key(sha256: list[str]) -> str:
    """A stored tier's identity: its shards' sha256 in order (the same bytes decode to the same pixels)."""
    return ",".join(sha256)


def materialize_tiers(spec: IngestSpec, budget_mb: float, num_cpus: float = 0.5, pending: list | None = None,
                      shared: dict[str, list] | None = None) -> None:
    """Put the tiers that fit ``budget_mb`` decoded into the object store (smallest first, so the most
    tiers fit), and record which level serves each phase and validation. With ``pending`` (a list) the
    decode is started, not waited for (see :func:`shard_cache.materialize`). ``shared`` maps
    :func:`tier_key` to refs decoded once for several runs (a search's trials): those tiers are not decoded
    again."""
    users: dict[tuple, list[tuple[str, TierShards]]] = {}
    for ph in spec.phases:
        users.setdefault(tuple(ph.shards.sha256), []).append((f"phase {ph.index} ({ph.resolution}px)", ph.shards))
    users.setdefault(tuple(spec.val.sha256), []).append(("validation", spec.val))
    sizes = {key: shard_cache.decoded_bytes(group[0][1].uris) for key, group in users.items()}
    # Never plan past half the object store: beyond that Ray spills to disk, a slower copy of level 2.
    store = ray.cluster_resources().get("object_store_memory", 0.0)
    left = min(float(budget_mb) * 2**20, 0.5 * store) if store else float(budget_mb) * 2**20
    if left < float(budget_mb) * 2**20:
        spec.event("data_cache", f"data.memory_budget_mb={budget_mb:g} capped at {left / 2**20:.0f} MB: half of the "
                                 f"cluster's {store / 2**20:.0f} MB object store", level="cap")
    for key in sorted(users, key=lambda k: sizes[k]):
        group = users[key]
        tier = group[0][1]
        mb = sizes[key] / 2**20
        if not tier.uris:
            continue
        if shared and tier_key(tier.sha256) in shared:
            for _, t in group:
                t.refs = shared[tier_key(tier.sha256)]
            for name, _ in group:
                spec.event("data_cache", f"{name} reads object store: tier {tier.tier} decoded once for every run "
                                         f"that shares it ({mb:.1f} MB, {len(tier.uris)} shards)",
                           level="object_store", tier=tier.tier, decoded_mb=round(mb, 2), served=name, shared=True)
            continue
        if sizes[key] <= left:
            t0 = time.perf_counter()
            refs = shard_cache.materialize(tier.uris, tier.sha256, tier.fmt, spec.local_dir, num_cpus, pending,
                                           spec.local_max_bytes)
            left -= sizes[key]
            for _, t in group:
                t.refs = refs
            took = "decoding while the workers start" if pending is not None else \
                f"{time.perf_counter() - t0:.1f} s"
            why = f"object store: tier {tier.tier} decoded once ({mb:.1f} MB, {len(refs)} shards, " \
                  f"{took}); later epochs skip disk and decode"
        else:
            why = f"node-local disk {spec.local_dir} (copied once per node from shared storage): tier " \
                  f"{tier.tier} is {mb:.1f} MB decoded, over the {left / 2**20:.1f} MB left of " \
                  f"data.memory_budget_mb={budget_mb:g}"
        for name, _ in group:
            spec.event("data_cache", f"{name} reads {why}", level=tier.level, tier=tier.tier,
                       decoded_mb=round(mb, 2), served=name)


class PlanDataConfig(ray.train.DataConfig):
    """Gives each rank its own ordered stream of its slice of every global batch."""

    def __init__(self, spec: IngestSpec, cpus_per_worker: float | None = None,
                 record: Callable[[dict[str, Any]], None] | None = None,
                 probe: Callable[[], dict[str, Any] | None] | None = None):
        """``cpus_per_worker``: what each Train worker reserves; given, each worker-group start sizes Ray Data's
        CPU share from the cluster then (app/data/data_share.py) and decides again where the phases of
        ``data.decode_on=auto`` decode (app/data/start_decode.py; ``probe`` returns rank 0's decode timing of
        this start); each start's units go to ``record`` once (the driver's run log). Else the driver's cap
        and placement stand."""
        super().__init__(datasets_to_split=[])
        self.spec = spec
        self.cpus_per_worker, self.record, self.probe = cpus_per_worker, record, probe
        self._started = False  # this object is copied into each worker-group start's dataset manager
        self._tasks = spec.map_concurrency

    def _start(self, ctx: Any, world_size: int, worker_node_ids: list | None) -> tuple[Any, int | None]:
        """(Ray Data's resource limits, tasks in flight for all ranks) of this worker-group start; planned at its
        first dataset and said once: the data share, the tasks in flight and the decode placement."""
        from ray.data import ExecutionResources

        if self.cpus_per_worker is None:
            return ctx.execution_options.resource_limits, self.spec.map_concurrency
        share = data_share.data_cpu_share(world_size, self.cpus_per_worker)
        ctx.execution_options.resource_limits = ExecutionResources(cpu=share["data_cpus"])
        if not self._started:  # once per start, before the first map task is made
            self._started = True
            said = []
            if any(ph.decode_rates is not None for ph in self.spec.phases):
                said += start_decode.plan_start(self.spec, world_size, share["data_cpus"],
                                                self.probe() if self.probe else None, autotune.node_cores())
            self._tasks, why = self._start_tasks(share)  # after the decode plan: it times the start's own work
            nodes = len(set(worker_node_ids or []))
            message = (data_share.describe(share, world_size, nodes) +
                       f"; {self._tasks or 'default'} tasks in flight x {self.spec.map_cpus:g} CPU ({why})")
            said.insert(0, {"event": "unit", "unit": "data_share", "message": message, "world_size": world_size,
                            "nodes": nodes, "tasks_in_flight": self._tasks, "task_cpus": self.spec.map_cpus,
                            **share})
            for rec in said:
                units.unit_log(rec["unit"], rec["message"], **{k: v for k, v in rec.items()
                                                              if k not in ("event", "unit", "message")})
                if self.record is not None:
                    self.record(rec)
        return ctx.execution_options.resource_limits, self._tasks

    def _start_tasks(self, share: dict[str, Any]) -> tuple[int | None, str]:
        """Tasks in flight for all ranks at this start (and why): timed again on this start's CPUs when they are
        far from the calibration's (this start's copy of the spec takes the new task CPUs), else scaled."""
        spec = self.spec
        if spec.calibration_seconds > 0 and data_share.calibrate_again(spec.map_concurrency_cpus, share["data_cpus"]):
            was = spec.map_concurrency_cpus
            choice = autotune.apply(spec, block_rows=spec.block_rows, seconds=spec.calibration_seconds,
                                    train_cpus=share["train_cpus"])  # block rows stay: the blocks are cut by them
            return choice.concurrency, f"calibrated again at this start, {was:g} CPUs then: {choice.reason}"
        return data_share.start_concurrency(spec.map_concurrency, spec.map_concurrency_cpus, share["data_cpus"])

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        from ray.data import ExecutionOptions
        from ray.data.context import DataContext

        ctx = DataContext.get_current()
        limits, tasks = self._start(ctx, world_size, worker_node_ids)
        options = ExecutionOptions(resource_limits=limits, preserve_order=True)
        # Tasks in flight are for the whole cluster; each rank's stream gets its share.
        per_rank = ray.data.TaskPoolStrategy(size=rank_task_share(tasks, world_size))
        out = [{} for _ in range(world_size)]
        for name, ds in datasets.items():
            for rank in range(world_size):
                fn_and_kwargs = self.map_for(name, rank, world_size)
                mapped = ds
                if fn_and_kwargs is not None:
                    fn, fn_kwargs = fn_and_kwargs
                    mapped = ds.map_batches(fn, batch_size=1, batch_format="numpy", num_cpus=self.spec.map_cpus,
                                            compute=per_rank, fn_kwargs=fn_kwargs)
                mapped.context.execution_options = options
                out[rank][name] = mapped.iterator()
        return out

    def map_for(self, name: str, rank: int, world_size: int) -> tuple[Any, dict] | None:
        """The map function (and its kwargs) that turns dataset ``name``'s blocks into rank's rows."""
        if name.startswith("train_p"):
            return train_block_batch, {"spec": self.spec, "phase": int(name.removeprefix("train_p")), "rank": rank,
                                      "world_size": world_size}
        if name == "val":
            return val_block_batch, {"spec": self.spec, "rank": rank, "world_size": world_size,
                                    "resolution": self.spec.eval_resolution}
        if name.startswith("val_r"):  # one resolution of the end-of-run eval sweep
            sub = self.spec.sweep[int(name.removeprefix("val_r"))]
            return val_block_batch, {"spec": sub, "rank": rank, "world_size": world_size,
                                    "resolution": sub.eval_resolution}
        return None


def add_eval_sweep(spec: IngestSpec, resolutions: list[int], val_tiers: dict[int, TierShards], data: Any) -> None:
    """One validation spec per sweep resolution, read from ``val_tiers[r]`` (a stored tier, resized on the
    fly); rectangular validation is planned again at each resolution. Call after ``finalize_spec``."""
    for r in sorted(set(resolutions)):
        sub = dataclasses.replace(spec, val=val_tiers[r], eval_resolution=r, val_mode="center", val_order=None,
                                  val_batches=[], events=[], sweep={})
        if data.val_mode == "rect":
            plan_rect_validation(sub, data.val_batch_size)
        spec.sweep[r] = sub


def plan_augmentation(spec: IngestSpec, augment_on: str, workers_use_cuda: bool) -> None:
    """Where each phase's training crops run: ``data.augment_on`` resolved for the workers' device; the device
    path needs a tier stored decoded (raw), so a JPEG tier stays on the CPU path and the event says so."""
    mode, why = augment.resolve_augment_on(augment_on, workers_use_cuda)
    spec.augment_on = mode
    where = "cuda" if workers_use_cuda else "cpu"
    for ph in spec.phases:
        ph.device_augment = mode == "device" and ph.shards.fmt == "raw"
        if ph.device_augment and ph.shards.uris:
            hw = [shard_cache.read_columns(u, ["height", "width"]) for u in ph.shards.uris]
            ph.canvas = augment.canvas_for(np.concatenate([t.column("height").to_numpy() for t in hw]),
                                           np.concatenate([t.column("width").to_numpy() for t in hw]))
        if ph.device_augment:
            msg = (f"phase {ph.index} ({ph.resolution}px): crop+resize+flip as one batched roi_align on the "
                   f"workers' device ({where}{'; the device path on the CPU device' if where == 'cpu' else ''}); "
                   f"tasks copy windows onto a {ph.canvas[0]}x{ph.canvas[1]} canvas ({why})")
        elif mode == "device":
            msg = (f"phase {ph.index} ({ph.resolution}px): on the CPU in Ray Data tasks: tier {ph.shards.tier} is "
                   f"stored as {ph.shards.fmt}, the device path needs a raw tier (data.raw_max_resolution >= "
                   f"{ph.shards.tier}) ({why})")
        else:
            msg = f"phase {ph.index} ({ph.resolution}px): on the CPU in Ray Data tasks ({why})"
        spec.event("augment_on", msg, phase=ph.index, on="device" if ph.device_augment else "cpu", device=where,
                   canvas=list(ph.canvas) if ph.device_augment else None)


def plan_decode(spec: IngestSpec, decode_on: str, workers_use_cuda: bool, cpus_per_gpu: float,
                seconds: float = 1.0, before_measure: Any = None, model_img_s: float = 0.0) -> None:
    """Where each JPEG phase is decoded: ``data.decode_on`` resolved per phase (``auto`` on CUDA workers compares
    what each placement leaves the training rate, see :func:`autotune.choose_decode`). ``cpus_per_gpu``: units
    of Ray's CPU resource each GPU has for data (the physical cores behind them are counted there);
    ``model_img_s``: the model's training rate per GPU (``data.decode_model_img_s``; 0 = unknown). Only a JPEG
    tier read from disk qualifies: a raw tier has nothing to decode and an object-store tier was decoded once at
    start. Call after :func:`materialize_tiers`; ``before_measure`` (the wait for its decode tasks) runs before a
    timing, so the two do not share the CPUs."""
    where = "cuda" if workers_use_cuda else "cpu"
    measured: dict[tuple[int, int], autotune.DecodeChoice] = {}
    for ph in spec.phases:
        ph.device_decode = False
        if ph.device_augment or ph.shards.fmt != "jpeg" or not ph.shards.uris:
            continue
        if ph.shards.refs is not None:
            spec.event("decode_on", f"phase {ph.index} ({ph.resolution}px): decoded once at start into the object "
                                    f"store (tier {ph.shards.tier}): nothing left to decode per epoch",
                       phase=ph.index, on="object_store", device=where)
            continue
        # Phases reading one tier at one crop share a measurement; a choice is per tier and crop work.
        key = (ph.shards.tier, ph.resolution)
        choice = measured.get(key) or autotune.choose_decode(spec, ph.index, decode_on, workers_use_cuda,
                                                             cpus_per_gpu, seconds, before_measure, model_img_s)
        measured[key] = choice
        ph.device_decode = choice.on == "device"
        if decode_on == "auto" and workers_use_cuda and choice.cpu_img_s_per_cpu:
            ph.decode_rates = {"cpu_img_s_per_cpu": choice.cpu_img_s_per_cpu, "device_img_s": choice.device_img_s,
                               "model_img_s": choice.model_img_s}
        if ph.device_decode:
            how = ("batched nvJPEG on the workers' GPU" if workers_use_cuda else
                   "decode_jpeg on the CPU device in the Train worker (the device path on the CPU device)")
            msg = (f"phase {ph.index} ({ph.resolution}px): JPEG tier {ph.shards.tier} decoded by {how}, then "
                   f"crop+resize+flip there; tasks pass the bytes through ({choice.reason})")
        else:
            msg = f"phase {ph.index} ({ph.resolution}px): JPEG decode in Ray Data tasks on the CPU ({choice.reason})"
        if ph.decode_rates is not None:
            msg += "; decided again at each worker-group start from the GPUs it gets"
        spec.event("decode_on", msg, phase=ph.index, on=choice.on, device=where,
                   cpu_img_s_per_cpu=choice.cpu_img_s_per_cpu, device_img_s=choice.device_img_s,
                   cpus_per_gpu=choice.cpus_per_gpu, cores_per_gpu=choice.cores_per_gpu,
                   model_img_s=choice.model_img_s, train_img_s=choice.train_img_s)


def finalize_spec(spec: IngestSpec, data: Any, train_cpus: float, workers_use_cuda: bool = False,
                  shared_tiers: dict[str, list] | None = None, ranks: int = 1) -> None:
    """The start-up steps that need the cluster, in order: where augmentation runs, rect validation plan,
    object-store level, preprocessing calibration (last, so it times the level that will really serve).
    ``data`` is the config's DataConfig; ``train_cpus`` what the Train workers reserve; ``shared_tiers``
    tiers already decoded for several runs (see :func:`materialize_tiers`); ``ranks`` the Train workers that split
    each plan block (the most the run starts)."""
    from lightray import startup

    spec.block_rows = data.block_rows or BLOCK_ROWS
    spec.calibration_seconds = data.autotune_seconds
    plan_augmentation(spec, data.augment_on, workers_use_cuda)
    if data.val_mode == "rect":
        with startup.phase("rect_val_plan"):
            plan_rect_validation(spec, data.val_batch_size)
    # The decode into the object store overlaps the worker group's start; only a calibration, which must
    # time the level that will serve, waits for it.
    pending: list = []
    with startup.phase("materialisation"):
        materialize_tiers(spec, data.memory_budget_mb, data.prepare_cpus_per_task, pending, shared_tiers)
    with startup.phase("decode_plan"):
        gpus = ray.cluster_resources().get("GPU", 0.0) if workers_use_cuda else 0.0
        plan_decode(spec, data.decode_on, workers_use_cuda, autotune.data_cpus(train_cpus) / max(1.0, gpus),
                    before_measure=lambda: ray.get(pending), model_img_s=data.decode_model_img_s)
    with startup.phase("calibration"):
        autotune.apply(spec, concurrency=data.preprocess_concurrency, cpus=data.preprocess_cpus,
                       block_rows=data.block_rows, seconds=data.autotune_seconds, train_cpus=train_cpus,
                       before_measure=lambda: ray.get(pending), ranks=ranks)
