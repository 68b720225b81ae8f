"""The per-worker trainer: one object per worker-group start, holding everything a worker trains with.

A start resumes from the checkpoint chosen for it (``resume.json``), then walks the schedule phase by
phase: each phase's data arrives as this rank's slice of every global batch from the worker's context
(``app/train/context.py``: Ray Train's ``get_dataset_shard("train_p<i>")``, or a one-worker run's own
streams). Everything that decides the next step (LR, resolution, batch) is computed from ``samples_seen``.

``state_dict()`` / ``load_state_dict()`` follow the Stateful protocol: rank 0's dict holds the replicated
state (model, optimizer, grad scaler, EMA, counters, config); every rank's dict holds its own
communication residuals and RNG states.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist
from ray.exceptions import RayActorError
from torch.nn.parallel import DistributedDataParallel as DDP

from lightray import storage, units
from lightray.comm.fusion import choose_bucket_mb
from lightray.comm.hook import CommHook
from lightray.comm.topology import Topology
from lightray.config import Config, Phase, config_from_dict
from lightray.data import device_decode, start_decode, warm_workers
from lightray.data.plan import rank_slice
from lightray.data.spec import IngestSpec
from lightray.plain_rng import numpy_rng_from_plain, numpy_rng_to_plain
from lightray.report.runlog import get_runlog
from lightray.schedule import Position, Schedule
from lightray.storage import join
from lightray.train import accumulate, host_memory
from lightray.train import device as dev
from lightray.train.agreement import agree
from lightray.train.context import current_train_run_id
from lightray.train.ema import ModelEMA
from lightray.train.evaluate import evaluate as evaluate_split
from lightray.train.export import ModelExporter
from lightray.train.finetune import HeadWarmup
from lightray.train.lookahead import Lookahead
from lightray.train.lookahead import describe as describe_lookahead
from lightray.train.model import build_model, to_device
from lightray.train.optim import build_loss, build_optimizer, clip_gradients, set_lr_momentum
from lightray.train.phase_streams import PhaseStreams
from lightray.train.prefetch import DevicePrefetcher
from lightray.train.shift import describe as describe_shift
from lightray.train.shift import shift_batch
from lightray.train.state import (
    ResumePoint,
    checkpoint_name,
    load_rank_state,
    read_recorded_resume,
    save_rank_state,
)
from lightray.train.whiten import whiten_first_batch, whitening_stem

RANK_KEYS = ("comm", "rng")  # every rank's own part of a checkpoint; the rest is rank 0's replicated state


class PreemptedError(RayActorError):
    """Raised after the preemption checkpoint so that Ray Train restarts the group off the draining node.

    A ``RayActorError`` marked ``preempted``: Ray Train charges a worker group whose error is one of those to
    ``max_preemption_failures`` (unlimited in lightray), not to ``max_failures``, so spot notices do not use up
    the budget kept for real errors (``lightray.ray_private.check`` says so loudly if an upgrade changes that)."""

    def __init__(self, message: str):
        super().__init__(error_msg=message, preempted=True)
        self.message = message

    def __reduce__(self):  # the worker's error travels to the controller pickled
        return (type(self), (self.message,))


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the message names the folder and the cause in one line."""


class RunLogReporter:
    """Sends metrics/events to the run log (rank 0 only) without blocking the step."""

    def __init__(self, run_name: str, rank: int):
        self.actor = get_runlog(run_name) if rank == 0 else None

    def __call__(self, record: dict[str, Any]) -> Any:
        if self.actor is not None:
            try:
                return self.actor.log.remote(record)
            except Exception:  # the driver (and its log) may be gone; training goes on
                self.actor = None
        return None

    def logged(self, record: dict[str, Any]) -> None:
        """Log ``record`` and wait until the log holds it (a record another process reads next)."""
        ref = self(record)
        try:
            if ref is not None:
                ray.get(ref)
        except ray.exceptions.RayError:  # the driver (and its log) may be gone; training goes on
            self.actor = None


@dataclass
class Counters:
    """Run-wide counters carried across starts in rank 0's checkpoint (as a plain dict, in this order)."""

    samples_seen: int = 0
    step: int = 0
    starts: int = 0
    device_seconds: float = 0.0
    train_seconds: float = 0.0
    resizes: int = 0
    preemption_checkpoints: int = 0
    world_size: int = 0
    best_top1: float = 0.0

    def update(self, saved: dict[str, Any]) -> None:
        known = {f.name for f in fields(self)}
        for key, value in saved.items():
            if key in known:
                setattr(self, key, value)


@dataclass
class PhaseRun:
    """The phase being trained: its config, index, this rank's share of each global batch and the micro-steps
    that share is cut into (``app/train/accumulate.py``)."""

    index: int
    phase: Phase
    loss_scale: float  # DDP averages over ranks: weight each rank's loss by its share of the batch
    micro_steps: int = 1


def loss_scale(global_batch: int, world: int, rank: int) -> float:
    """The factor on rank's mean loss that makes DDP's average over ranks the global batch's mean loss.

    Rank r averages its n_r samples; DDP averages the W gradients. Weighting by n_r * W / B gives
    (1/W) sum_r (n_r W / B) mean_r = (1/B) sum of every sample's loss, exactly, even for uneven splits."""
    lo, hi = rank_slice(global_batch, world, rank)
    return (hi - lo) * world / global_batch


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": numpy_rng_to_plain(np.random.get_state()),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict) -> None:
    # Generators take only CPU byte tensors, whichever device the state was loaded to.
    torch.set_rng_state(s["torch"].cpu())
    n = s["numpy"]
    np.random.set_state(numpy_rng_from_plain(n) if isinstance(n, dict) else n)  # a tuple: format 1 pickled it
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.cpu() for t in s["cuda"]])


def _new_window() -> dict[str, Any]:
    """Accumulators for one report interval. ``loss`` becomes a device tensor at the first step and is read
    on the host only when the interval is reported: a read per step would wait for the step's kernels."""
    return {"t": time.time(), "wait": 0.0, "n": 0, "loss": 0.0, "steps": 0}


def _rows(batch: dict, key: str, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of one of the batch's arrays as a tensor (a view: NumPy from the stream, or a tensor the
    prefetcher already put on the device)."""
    value = batch[key]
    return value[lo:hi] if isinstance(value, torch.Tensor) else torch.from_numpy(value[lo:hi])


class Trainer:
    """One worker's model, optimizer, communication and counters, and the loop that trains them."""

    def __init__(self, cfg: Config, spec: IngestSpec, run_dir: str, num_classes: int, *, rank: int, world: int,
                 topology: Topology | None = None, report: Callable[[dict[str, Any]], None] | None = None,
                 ctx: Any = None):
        self.cfg, self.spec, self.run_dir = cfg, spec, run_dir
        self.rank, self.world = rank, world
        self.ctx = ctx  # lightray.train.context: Ray Train's worker context, or a one-worker run in this process
        self.report = report if report is not None else RunLogReporter(cfg.name, rank)
        self.t_start = time.time()
        self.device = dev.select_device()
        self.sched = Schedule(cfg.schedule, cfg.optim, spec.train_size)
        # With scaling.stream_ahead on, the stream of the phase this start begins in starts while the model and
        # DDP are built (a collective and seconds of work); off, nothing is read here (resume.json is restore's).
        self.streams = PhaseStreams(lambda name: self.ctx.dataset_shard(name), self._rank_rows,
                                    spec.prefetch_batches, self.device, device_prefetch=cfg.scaling.device_prefetch,
                                    ahead=cfg.scaling.stream_ahead, probe_first=bool(start_decode.needs_probe(spec)))
        # Before anything else of the start: the warm-up's process start and imports overlap the model's build.
        self.warm_refs = warm_workers.start(
            warm_workers.count(cfg.scaling.warm_data_workers, self.device.type == "cuda", spec.map_concurrency, world)
            if ctx is not None else 0,
            spec.map_cpus)
        if ctx is not None and self.streams.ahead:
            resumed_at = read_recorded_resume(run_dir).samples_seen
            first = self._next_phase(resumed_at)
            if first is not None:
                self.streams.open_ahead(first, resumed_at)
        self._build_model(num_classes, topology)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        self.scaler = dev.make_grad_scaler(self.precision, self.device)
        self.comm.follow_loss_scale(self.scaler)  # fp16: residuals kept unscaled, left as they were by a skipped step
        self.ema = ModelEMA(self.model, cfg.optim.ema_decay) if cfg.optim.ema_decay > 0 else None
        self.lookahead = Lookahead(self.model, cfg.optim.lookahead_every) if cfg.optim.lookahead_every else None
        self.stem = whitening_stem(self.model) if cfg.model.whiten_stem else None  # whitened at a fresh run's step 0
        self.loss_fn = build_loss(cfg.optim)
        self.head_warmup = HeadWarmup(self.model, cfg.model.head_warmup_epochs, spec.train_size, cfg.model.pretrained)
        self.exporter: ModelExporter | None = None  # rank 0's, made at restore (it needs the best top-1 so far)
        self.counters = Counters(world_size=world)
        self.clock = time.time()  # start of the time not yet added to the counters' seconds
        self.last_ckpt_time = time.time()
        self.notice_seen: Any = None  # one preemption checkpoint per notice, not one per report interval
        self.window = _new_window()
        self.metrics: dict[str, Any] = {}
        self.sample_log = None
        self.stopped = False
        self.resume_step = 0

    @classmethod
    def from_train_config(cls, config: dict, ctx: Any = None) -> Trainer:
        """The trainer of the calling worker, from ``train_loop_config``; ``ctx`` defaults to Ray Train's."""
        from lightray.train.context import RayTrainContext

        ctx = ctx or RayTrainContext()
        return cls(config_from_dict(config["cfg"]), config["spec"], config["run_dir"], config["num_classes"],
                   rank=ctx.rank, world=ctx.world, ctx=ctx, report=ctx.log)

    def _build_model(self, num_classes: int, topology: Topology | None) -> None:
        """Device, model, DDP wrapper and comm hook. Collectives inside: every rank builds in the same order."""
        cfg = self.cfg
        self.precision = dev.precision_for(cfg.model, self.device)
        dev.enable_cudnn_benchmark(cfg.model, self.device)
        torch.manual_seed(cfg.scaling.seed)  # same initial weights on every rank
        self.model = to_device(build_model(cfg.model, num_classes), self.device, cfg.model)
        topology = topology or self.ctx.topology()  # after select_device: NCCL's all-reduce uses our GPU
        self.bucket_mb, self.bucket_evidence = choose_bucket_mb(self.model, self.world, self.device,
                                                                pinned_mb=cfg.comm.bucket_mb,
                                                                saved_mb=self._saved_bucket_mb())
        self.ddp = DDP(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                       bucket_cap_mb=self.bucket_mb, gradient_as_bucket_view=True)
        self.comm = CommHook(cfg.comm, topology, self.device, optimizer=cfg.optim.name,
                             nesterov=cfg.optim.nesterov and cfg.optim.momentum > 0,
                             timeout_s=cfg.scaling.collective_timeout_s)
        self.comm.install(self.ddp)
        self.forward = dev.maybe_compile(self.ddp, cfg.model, self.device)
        dev.normalization_constants(self.device)  # made here, with the model, and never in a step

    def _saved_bucket_mb(self) -> float:
        """The DDP bucket size of the checkpoint this start resumes from, when it ran at this world size (else 0).

        The bucket layout decides which entries top-k selects from together, so a size measured afresh (the
        timings differ from start to start) would change what the run learns after a restart. Every rank
        reads the same recorded resume point and rank 0's meta, so all skip the measurement (a collective)
        or none does."""
        resume = read_recorded_resume(self.run_dir)
        if not resume.checkpoint or resume.world_size != self.world:
            return 0.0
        return float(storage.read_json(join(resume.checkpoint, "meta_rank0.json")).get("bucket_mb", 0.0))

    # --- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's checkpoint content: its own comm residuals and RNG; on rank 0 the replicated state too."""
        state: dict[str, Any] = {"comm": self.comm.state_dict(), "rng": rng_state()}
        if self.rank == 0:
            state.update(model=self.model.state_dict(), optimizer=self.optimizer.state_dict(),
                         scaler=self.scaler.state_dict(), ema=self.ema.state_dict() if self.ema is not None else None,
                         lookahead=self.lookahead.state_dict() if self.lookahead is not None else None,
                         counters=asdict(self.counters), config=self.cfg.to_dict())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load rank 0's replicated state; ``comm`` and ``rng`` only where present (this rank's own)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None and state.get("ema"):
            self.ema.load_state_dict(state["ema"])
        if self.lookahead is not None and state.get("lookahead"):
            self.lookahead.load_state_dict(state["lookahead"])
        self.counters.update(state["counters"])
        if "comm" in state:
            self.comm.load_state_dict(state["comm"], world_size=self.world)
        if "rng" in state:
            set_rng_state(state["rng"])

    def _read_checkpoint(self, resume: ResumePoint) -> dict[str, Any]:
        """Rank 0's replicated state plus this rank's own part, as ``load_state_dict`` takes it."""
        trust = self.cfg.checkpoint.allow_pickle
        shared = load_rank_state(resume.checkpoint, 0, allow_pickle=trust)
        state = {k: v for k, v in shared.items() if k not in RANK_KEYS}
        if self.rank < resume.world_size:  # a rank the checkpointing group did not have has no own part
            own = load_rank_state(resume.checkpoint, self.rank, allow_pickle=trust)
            state.update({k: own[k] for k in RANK_KEYS if k in own})
        if resume.world_size != self.world:
            state.pop("rng", None)  # exact replay only holds for the same ranks; a resized group draws afresh
        return state

    def restore(self) -> ResumePoint:
        """Load the checkpoint chosen for this start (if any) and announce the start."""
        resume = read_recorded_resume(self.run_dir)
        c = self.counters
        if resume.checkpoint:
            self.load_state_dict(self._read_checkpoint(resume))
            if resume.world_size != self.world:
                c.resizes += 1
                self.report({"event": "resize", "from": resume.world_size, "to": self.world,
                             "samples_seen": c.samples_seen})
        if c.samples_seen != resume.samples_seen:
            raise RuntimeError(f"checkpoint {resume.checkpoint} holds samples_seen={c.samples_seen} but the "
                               f"data stream was built for {resume.samples_seen}")
        c.starts += 1
        c.world_size = self.world
        if self.rank == 0:
            self.exporter = ModelExporter(self.run_dir, self.cfg, c.best_top1)
        self.report({"event": "start" if c.starts == 1 else "restart", "samples_seen": c.samples_seen,
                     "world_size": self.world, "checkpoint": resume.checkpoint, "skipped_checkpoints": resume.skipped,
                     "total_samples": self.sched.total_samples, "ckpt_time": resume.time,
                     # Ray Train's id of this attempt: a resuming driver cancels its resource bookings by it
                     "train_run_id": current_train_run_id(),
                     # This worker's own share of the group start (model, DDP, comm hook, checkpoint read),
                     # so the start-up breakdown can tell it from Ray Train's process start.
                     "setup_s": round(time.time() - self.t_start, 3)})
        return resume

    # --- the loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        """Restore, then train every remaining phase; ends with the comm statistics and a barrier."""
        try:
            self._run()
        finally:
            self.streams.close()  # a stream opened ahead for a phase this start did not reach

    def _run(self) -> None:
        self.restore()
        self.resume_step = self.counters.step  # the first step after it ends this start's start-up
        self._probe_decode()
        self._log_units()
        self.sample_log = self._open_sample_log()
        self.clock = time.time()
        self.last_ckpt_time = time.time()
        if self.counters.samples_seen >= self.sched.total_samples:  # resumed a run that had already finished
            self.report({"event": "end", "samples_seen": self.counters.samples_seen, "wall_s": 0.0})
            return
        pos = self.sched.locate(self.counters.samples_seen)
        self.window = _new_window()
        for phase_idx in self._phases_with_epochs(pos.phase_index):
            self.run_phase(phase_idx, pos)
            if self.stopped:
                self.report({"event": "stopped", "samples_seen": self.counters.samples_seen,
                             "step": self.counters.step})
                break
        if not self.stopped:
            self.eval_sweep()
        self._finish()

    def _probe_decode(self) -> None:
        """``data.decode_on=auto`` phases whose GPU decode rate the driver could not time (no GPU was up): rank 0
        times decode_jpeg on its own device and logs it before any rank asks for a dataset, which is when this
        start's data plan reads it (app/data/start_decode.py). Every rank has the same spec: all wait or none."""
        if not start_decode.needs_probe(self.spec):
            return
        if self.rank == 0:
            record = start_decode.probe_on_worker(self.spec, self.device)
            getattr(self.report, "logged", self.report)(record)
        if self.world > 1:
            dist.barrier()

    def _rank_rows(self, phase_idx: int) -> int:
        """This rank's rows of each global batch of phase ``phase_idx``."""
        lo, hi = rank_slice(self.cfg.schedule.phases[phase_idx].batch_size, self.world, self.rank)
        return hi - lo

    def _phases_with_epochs(self, first: int) -> list[int]:
        """The phases from ``first`` on that have epochs to train (the budget can leave a phase none)."""
        return [i for i in range(first, len(self.spec.phases))
                if self.spec.phases[i].end_epoch > self.spec.phases[i].first_epoch]

    def _next_phase(self, samples_seen: int, after: int = -1) -> int | None:
        """The first phase after ``after`` with epochs left to train from ``samples_seen`` (None when none)."""
        if samples_seen >= self.sched.total_samples:
            return None
        return next(iter(self._phases_with_epochs(max(self.sched.locate(samples_seen).phase_index, after + 1))), None)

    def phase_run(self, phase_idx: int) -> PhaseRun:
        """The phase's PhaseRun, with its micro-steps agreed across ranks (a collective: every rank calls it at
        the start of the phase); reports the ``accumulation`` unit."""
        phase = self.cfg.schedule.phases[phase_idx]
        cap, how = accumulate.resolve_cap(self.cfg.scaling.max_batch_per_device, self.model, phase.resolution,
                                          self.device, self.precision, self.cfg.model.channels_last,
                                          self._rank_rows(phase_idx))
        agreed = accumulate.agree_cap(cap, self.device)
        if agreed != cap:
            how += f"; {agreed} agreed: the smallest of any rank"
        plan = accumulate.plan_phase(phase_idx, phase.batch_size, self.world, agreed, how, self.cfg.model.global_bn)
        self.report({"event": "unit", **plan.event()})
        return PhaseRun(phase_idx, phase, loss_scale(phase.batch_size, self.world, self.rank), plan.micro_steps)

    def run_phase(self, phase_idx: int, pos: Position) -> None:
        """Train the phase's epochs from ``pos``, validating and checkpointing at each epoch's end."""
        phase = self.cfg.schedule.phases[phase_idx]
        run = self.phase_run(phase_idx)
        batches = self.streams.take(phase_idx)
        opened = self.streams.opened_at.get(phase_idx)
        self.report({"event": "unit", "unit": "progressive_resize",
                     "message": f"phase {phase_idx}: {phase.resolution}px, global batch {phase.batch_size}, "
                                f"min crop scale {phase.min_scale}"
                                + (f"; its stream opened ahead at {opened} samples" if opened is not None else ""),
                     "phase": phase_idx, "stream_opened_at": opened})
        compiled_before = dev.compile_counts() if isinstance(self.forward, dev.CompiledForward) else None
        try:
            self._run_phase_epochs(phase_idx, pos, run, batches)
        finally:
            batches.close()
        if compiled_before is not None:
            self._report_compiles(run, compiled_before)

    def _run_phase_epochs(self, phase_idx: int, pos: Position, run: PhaseRun, batches: Iterator[dict]) -> None:
        ph_spec = self.spec.phases[phase_idx]
        following = self._next_phase(self.counters.samples_seen, after=phase_idx)
        for epoch in range(max(ph_spec.first_epoch, pos.epoch), ph_spec.end_epoch):
            first_step = pos.step_in_epoch if epoch == pos.epoch else 0
            if epoch == ph_spec.end_epoch - 1 and following is not None:
                self.streams.open_ahead(following, self.counters.samples_seen)  # its start overlaps this epoch
            if not self.run_epoch(epoch, first_step, run, batches):
                return  # stopped mid-epoch: the interval checkpoint holds the position
            self.end_epoch(epoch, run)
            if self.stopped:
                return

    def _report_compiles(self, run: PhaseRun, before: dict[str, Any]) -> None:
        """The ``compile`` unit's line for the phase just trained: how many graphs dynamo compiled at its
        resolution (the shape policy's promise is one, whatever the per-rank batches, which it lists) and
        its graph breaks with their reasons. Evaluation runs eager, so only training steps count."""
        delta = dev.compile_delta(before, dev.compile_counts())
        sizes = self.forward.pop_batch_sizes()
        breaks = delta["graph_breaks"]
        self.report({"event": "unit", "unit": "compile", "phase": run.index, "resolution": run.phase.resolution,
                     "batch_sizes": sizes, **delta,
                     "message": f"phase {run.index} ({run.phase.resolution}px): {delta['compiles']} compile(s) for "
                                f"per-rank batches of {sizes}, {breaks} graph break(s)"
                                + (f": {'; '.join(delta['break_reasons'])}" if breaks else "")})

    def run_epoch(self, epoch: int, first_step: int, run: PhaseRun, batches: Iterator[dict]) -> bool:
        """Train the epoch from ``first_step``; False when stopped before its last step."""
        self.model.train()
        last = self.sched.steps_in_epoch(epoch) - 1
        for step in range(first_step, last + 1):
            batch = self._next_batch(batches, epoch)
            lr, mom = self.train_step(batch, run)
            if self.counters.step == self.resume_step + 1:
                self.report({"event": "first_step", "step": self.counters.step, "time": time.time(),
                             "data_wait_s": self.window["wait"]})
            self._log_samples(batch, epoch)
            decision_step = self.counters.step % self.cfg.report.every_steps == 0
            if decision_step:
                self._report_window(epoch, run, lr, mom)
            self._maybe_checkpoint(last_in_epoch=step == last, decision_step=decision_step)
            if self.stopped:
                return step == last
        return True

    def _next_batch(self, batches: Iterator[dict], epoch: int) -> dict:
        t0 = time.time()
        batch = next(batches)
        self.window["wait"] += time.time() - t0
        if batch["epoch"][0] != epoch:
            raise RuntimeError(f"data stream out of step: got epoch {batch['epoch'][0]}, expected {epoch}")
        return batch

    def train_step(self, batch: dict, run: PhaseRun) -> tuple[float, float]:
        """One optimizer step on this rank's slice of the global batch, in ``run.micro_steps`` micro-steps whose
        gradients accumulate (DDP all-reduces at the last); returns (lr, momentum) used."""
        c = self.counters
        lr, mom = self.sched.lr_at(c.samples_seen), self.sched.momentum_at(c.samples_seen)
        self.comm.begin_step(c.samples_seen / self.spec.train_size)  # epochs seen drive the sparsity warm-up
        set_lr_momentum(self.optimizer, lr, self.comm.optimizer_momentum(mom))  # 0 under momentum correction
        n = len(batch["label"])
        parts = accumulate.micro_slices(n, run.micro_steps)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum: torch.Tensor | float = 0.0
        skipped: list[int] = []
        for k, (lo, hi) in enumerate(parts):
            if hi == lo:
                continue  # a share shorter than the micro-steps; never the last part (micro_slices)
            last = k == len(parts) - 1
            with contextlib.nullcontext() if last else self.ddp.no_sync():
                x, y = self._micro_inputs(batch, lo, hi, run, skipped)
                if self.stem is not None and c.step == 0 and k == 0:
                    self._whiten_stem(x)
                with dev.autocast(self.precision, self.device):
                    loss = self.loss_fn(self.forward(x), y)
                # The slice's mean loss is the size-weighted sum of the micro-batches' means.
                share = (hi - lo) / n
                self.scaler.scale(loss * (run.loss_scale * share)).backward()  # a pass-through unless fp16
            loss_sum = loss_sum + loss.detach().float() * share
        if skipped:
            self.report({"event": "decode_skipped", "sample_ids": skipped, "step": c.step})
        self.head_warmup.before_step(c.samples_seen)
        clip_gradients(self.model, self.optimizer, self.cfg.optim, self.scaler)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.ema is not None:
            self.ema.update(self.model)
        c.samples_seen += run.phase.batch_size
        c.step += 1
        if self.lookahead is not None:
            self.lookahead.after_step(self.model, c.step, c.samples_seen / self.sched.total_samples)
            if c.samples_seen >= self.sched.total_samples:
                self.lookahead.finish(self.model)
        self.window["n"] += run.phase.batch_size
        self.window["steps"] += 1
        self.window["loss"] = self.window["loss"] + loss_sum
        return lr, mom

    def _micro_inputs(self, batch: dict, lo: int, hi: int, run: PhaseRun,
                      skipped: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Images (normalised, on the device) and labels of rows [lo, hi) of the slice."""
        cl, res = self.cfg.model.channels_last, run.phase.resolution
        if "jpeg" in batch:  # device decode: decode_jpeg on this device, then the device path's batched crop
            part = {k: batch[k][lo:hi] for k in ("jpeg", "box", "flip", "sample_id")}
            d = device_decode.decode_batch(part, self.device)
            x = dev.augmented_to_device(d.canvas, d.boxes, d.flips, res, self.device, cl)
            labels = _rows(batch, "label", lo, hi)[torch.from_numpy(d.keep)]  # a dropped image loses its label
            skipped.extend(d.skipped)
        elif "box" in batch:  # the device path: crop, resize and flip the stored pixels here, in one batched op
            x = dev.augmented_to_device(_rows(batch, "image", lo, hi), _rows(batch, "box", lo, hi),
                                        _rows(batch, "flip", lo, hi), res, self.device, cl)
            labels = _rows(batch, "label", lo, hi)
        else:
            x = dev.images_to_device(_rows(batch, "image", lo, hi), self.device, cl)
            labels = _rows(batch, "label", lo, hi)
        if self.cfg.data.translate:
            ids = np.asarray(batch["sample_id"][lo:hi])
            ids = ids[d.keep] if "jpeg" in batch else ids  # the images device decode kept
            x = shift_batch(x, self.spec.seed, int(batch["epoch"][0]), ids, self.cfg.data.translate)
        return x, dev.host_to_device(labels, self.device)

    def _whiten_stem(self, x: torch.Tensor) -> None:
        """``model.whiten_stem`` at a fresh run's first step: set the stem from this batch (rank 0's, broadcast);
        the weight averages start again from the whitened model."""
        event = whiten_first_batch(self.stem, x, self.world)
        for average in (self.ema, self.lookahead):
            if average is not None:
                average.reset(self.model)
        if self.rank == 0:
            self.report({"event": "unit", **event})

    def _log_samples(self, batch: dict, epoch: int) -> None:
        if self.sample_log is not None:
            self.sample_log.write(json.dumps({"samples_seen": self.counters.samples_seen, "epoch": epoch,
                                              "ids": batch["sample_id"].tolist()}) + "\n")
            self.sample_log.flush()

    # --- reporting ---------------------------------------------------------------------------------
    def _elapsed_s(self) -> float:
        return self.counters.train_seconds + time.time() - self.clock

    def _device_seconds(self) -> float:
        return self.counters.device_seconds + (time.time() - self.clock) * self.world

    def _metrics(self, epoch: int, run: PhaseRun, lr: float, mom: float) -> dict[str, Any]:
        """The training metrics line of the report interval that just ended."""
        c, w, sched = self.counters, self.window, self.sched
        dt = time.time() - w["t"]
        return {"step": c.step, "samples_seen": c.samples_seen, "epoch": epoch,
                "epoch_progress": sched.locate(c.samples_seen).epoch_progress
                if c.samples_seen < sched.total_samples else float(sched.epochs),
                "phase": run.index, "resolution": run.phase.resolution, "batch_size": run.phase.batch_size,
                "lr": lr, "momentum": mom, "loss": float(w["loss"]) / w["steps"],  # the interval's one read
                "images_per_s": w["n"] / max(dt, 1e-9),
                "data_wait_frac": w["wait"] / max(dt, 1e-9), "comm_bytes": self.comm.bytes_sent,
                "comm_mode": self.cfg.comm.mode, "restarts": c.starts - 1,
                "resizes": c.resizes, "world_size": self.world,
                "device_seconds": self._device_seconds(), "elapsed_s": self._elapsed_s(),
                "total_samples": sched.total_samples}

    def _report_window(self, epoch: int, run: PhaseRun, lr: float, mom: float) -> None:
        self.metrics = self._metrics(epoch, run, lr, mom)
        self.report(self.metrics)
        self.window = _new_window()

    def _log_units(self) -> None:
        """Which speed-up units are on and why: device, DDP bucket, comm mode, then the data's own events
        (which cache level serves each phase, preprocessing autotune, rect val)."""
        dev.log_augment_placement(self.spec.augment_on, self.device,
                                  [ph.index for ph in self.spec.phases if ph.device_augment])
        # Phases of data.decode_on=auto are placed at each start, and said there (app/data/start_decode.py).
        decoded_here = [ph.index for ph in self.spec.phases if ph.device_decode and ph.decode_rates is None]
        if decoded_here:
            units.unit_log("decode_on", device_decode.describe(self.device, decoded_here), on="device",
                         device=self.device.type, phases=decoded_here)
        s = self.cfg.schedule
        shifts, views = describe_shift(self.cfg.data.translate, s.tta_translate, s.tta_flip)
        events = units.pop_unit_events() + [
            {"unit": "device_prefetch", "message": DevicePrefetcher.describe(self.device,
                                                                             self.cfg.scaling.device_prefetch),
             "enabled": self.cfg.scaling.device_prefetch, "device": self.device.type},
            {"unit": "stream_ahead", "enabled": self.streams.ahead, "message": self.streams.describe()},
            {"unit": "fusion", "message": f"DDP bucket {self.bucket_mb:.2f} MB", "evidence": self.bucket_evidence},
            {"unit": "comm", "message": self.comm.describe()},
            {"unit": "tta", "enabled": self.cfg.schedule.tta_flip or self.cfg.schedule.tta_translate > 0,
             "message": views}, {"unit": "translate", "enabled": self.cfg.data.translate > 0, "message": shifts},
            {"unit": "alternating_flip", "enabled": self.spec.flip == "alternate",
             "message": "each image mirrored in even epochs iff its hashed coin says so, the other way in odd ones"
             if self.spec.flip == "alternate" else "a coin per image and epoch"},
            {"unit": "eval_schedule", "enabled": self.cfg.schedule.eval_every_epochs != 1,
             "message": self.sched.describe_validation()},
            {"unit": "lookahead", "enabled": self.lookahead is not None,
             "message": describe_lookahead(self.cfg.optim.lookahead_every)},
            host_memory.describe(),
            warm_workers.describe(self.warm_refs, self.cfg.scaling.warm_data_workers, self.device.type == "cuda",
                                  self.spec.map_cpus)
        ] + list(self.spec.events)
        for ev in events:
            self.report({"event": "unit", **ev})

    def _open_sample_log(self):
        """This rank's log of the sample ids of every step (``report.log_samples``): in the run folder, or in
        ``report.sample_log_dir`` (a run on object storage has its log only there)."""
        folder = self.cfg.report.sample_log_dir or os.path.join(self.run_dir, "sample_log")
        if not self.cfg.report.log_samples or "://" in folder:
            return None
        os.makedirs(folder, exist_ok=True)
        # One file per rank and attempt; the attempt id (rank 0's clock) orders attempts that resumed from
        # the same checkpoint, so an audit can tell which replay the final model carries.
        attempt = torch.tensor([int(time.time() * 1000)], dtype=torch.int64, device=self.device)
        if dist.is_initialized():
            dist.broadcast(attempt, 0)
        name = f"start{self.counters.starts}_attempt{int(attempt.item())}_rank{self.rank}.jsonl"
        return open(os.path.join(folder, name), "a")

    # --- evaluation and checkpoints ----------------------------------------------------------------
    @property
    def validated_model(self) -> torch.nn.Module:
        """The weights that validation scores and the export writes: the EMA copy when EMA is on."""
        return self.ema.module if self.ema is not None else self.model

    def evaluate(self, final: bool = True) -> dict[str, float]:
        """Top-1/top-5 of the EMA weights (else the live ones) over the whole validation split. The translated
        test-time views (``schedule.tta_translate``) score the final validation only: they triple its cost, which
        on a 10-minute CIFAR-10 budget is more than a tenth of the training, for about 0.1-0.2% of top-1."""
        return evaluate_split(self.validated_model,
                              self.ctx.dataset_shard("val"), self.device, self.precision, self.cfg,
                              self.spec.prefetch_batches, translate=None if final else 0)

    def eval_sweep(self) -> None:
        """Score the final weights at each ``report.eval_sweep`` resolution (FixRes: the best test resolution
        sits above the final train resolution); one ``eval_sweep`` event lists them all."""
        if not self.spec.sweep:
            return
        model = self.ema.module if self.ema is not None else self.model
        results = {}
        for r in sorted(self.spec.sweep):
            val = evaluate_split(model, self.ctx.dataset_shard(f"val_r{r}"), self.device, self.precision,
                                 self.cfg, self.spec.prefetch_batches)
            results[str(r)] = {"top1": val["val_top1"], "top5": val["val_top5"]}
        if self.rank == 0:
            best = max(results, key=lambda k: results[k]["top1"])
            self.report({"event": "eval_sweep", "results": results, "best_resolution": int(best),
                         "eval_resolution": self.spec.eval_resolution})

    def end_epoch(self, epoch: int, run: PhaseRun) -> None:
        """Validate where the schedule says (``schedule.eval_every_epochs``), report the epoch's line and
        checkpoint. An epoch without validation reports its line without the ``val_*`` figures."""
        c = self.counters
        val: dict[str, float] = {}
        if self.sched.validates_after(epoch):
            val = self.evaluate(final=epoch + 1 >= self.sched.epochs)
            if self.exporter is not None:  # before best_top1 moves: it exports when this validation improves on it
                self.exporter.on_validation(self.validated_model, val, epoch + 1, c.samples_seen)
            c.best_top1 = max(c.best_top1, val["val_top1"])
        # an earlier epoch's figures never ride on this line
        earlier = {k: v for k, v in self.metrics.items() if not k.startswith("val_")}
        self.metrics = dict(earlier, **val, epoch=epoch + 1, samples_seen=c.samples_seen, step=c.step,
                            restarts=c.starts - 1, resizes=c.resizes, epoch_progress=float(epoch + 1),
                            best_top1=c.best_top1, elapsed_s=self._elapsed_s(),
                            device_seconds=self._device_seconds(), comm_bytes=self.comm.bytes_sent,
                            phase=run.index, resolution=run.phase.resolution, batch_size=run.phase.batch_size,
                            world_size=self.world, preemption_checkpoints=c.preemption_checkpoints)
        self.report(self.metrics)
        self.checkpoint("epoch", self.metrics)

    def _maybe_checkpoint(self, last_in_epoch: bool, decision_step: bool = False) -> None:
        """Interval checkpoints (every N steps, every N minutes, at ``stop_after_steps``) inside an epoch, and
        the spot notice's checkpoint; the epoch's last step is left to the end-of-epoch checkpoint.

        Step counts are the same on every rank. A rank's clock and its view of a drain notice are not: they
        are checked at decision steps (report steps) only and agreed across the group (:func:`agree`), so that
        every rank checkpoints, or leaves, at the same step."""
        ck, step = self.cfg.checkpoint, self.counters.step
        by_steps = ck.every_steps and step % ck.every_steps == 0
        self.stopped = bool(ck.stop_after_steps and step == ck.stop_after_steps)
        by_time = False
        if decision_step:
            due = bool(ck.every_minutes and time.time() - self.last_ckpt_time > 60 * ck.every_minutes)
            # Ray's preemption info is a collective: every rank asks at the same (decision) steps.
            notice = self.ctx.preemption_info()
            by_time, noticed = agree([due, notice is not None and self.notice_seen is None], self.device)
            if noticed:
                self.on_preemption(notice if notice is not None else "a drain notice that another rank received")
        if (by_steps or by_time or self.stopped) and not last_in_epoch:
            self.checkpoint("interval", dict(self.metrics, samples_seen=self.counters.samples_seen, step=step))

    def checkpoint(self, reason: str, metrics: dict[str, Any]) -> None:
        """Every rank writes its state file; the context (Ray Train, or a one-worker run's own copy) gathers
        them into ``checkpoint_<samples_seen>`` in the run folder."""
        now = time.time()
        self.counters.device_seconds += (now - self.clock) * self.world
        self.counters.train_seconds += now - self.clock
        self.clock = time.time()
        name = checkpoint_name(self.counters.samples_seen)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                meta = {"samples_seen": self.counters.samples_seen, "world_size": self.world, "reason": reason,
                        "time": time.time(), "step": self.counters.step, "bucket_mb": self.bucket_mb}
                save_rank_state(tmp, self.rank, self.state_dict(), meta)
                # The context copies the folder to storage here; a copy that fails part-way raises here too and
                # leaves a folder whose hashes do not match, which resume skips (app/train/state.py).
                self.ctx.report_checkpoint(metrics, tmp, name)
        except OSError as exc:  # disk full, permission, storage error: the worker group restarts or the run fails
            raise CheckpointWriteError(f"checkpoint write failed: {join(self.run_dir, name)} (rank {self.rank}): "
                                       f"{exc}; earlier checkpoints are kept") from exc
        self.last_ckpt_time = time.time()

    def on_preemption(self, notice: Any) -> None:
        """Checkpoint now and leave: steps after this checkpoint would be rolled back anyway, and the new
        worker group avoids the draining node."""
        self.notice_seen = notice
        self.counters.preemption_checkpoints += 1
        self.report({"event": "preemption_checkpoint", "samples_seen": self.counters.samples_seen,
                     "notice": str(notice)})
        self.checkpoint("preemption", dict(self.metrics))
        raise PreemptedError(f"node preemption notice {notice}; checkpoint written at "
                             f"samples_seen={self.counters.samples_seen}, restarting")

    def _finish(self) -> None:
        if self.sample_log is not None:
            self.sample_log.close()
        if self.exporter is not None:  # the weights that were last validated, when the run ended on a validation
            m = self.metrics
            validated = "val_top1" in m and m.get("samples_seen") == self.counters.samples_seen
            self.exporter.on_end(self.validated_model, m if validated else None, m.get("epoch", 0),
                                 self.counters.samples_seen)
        self.report({"event": "unit", "unit": "comm", "message": self.comm.describe(), "stats": self.comm.stats()})
        if self.rank == 0:
            self.report({"event": "end", "samples_seen": self.counters.samples_seen,
                         "wall_s": time.time() - self.t_start})
        if dist.is_initialized():
            dist.barrier()
