"""Gradient communication for DDP: dense, fp16/bf16, top-k with error feedback, hierarchical top-k.

One ``CommHook`` per worker is registered on the DDP model (``install``); DDP hands it each gradient
bucket (the flat concatenation of some parameters' local gradients) and takes back the averaged
bucket. Modes (``comm.mode``):

- ``dense``: ring all-reduce of the fp32 bucket (what DDP does by default).
- ``fp16`` / ``bf16``: the bucket is divided by the world size, cast, all-reduced, cast back.

Where no lightray unit needs the bucket (``comm.builtin``, on by default; :meth:`CommHook.builtin_path`), ``dense``
is DDP's own all-reduce and ``fp16``/``bf16`` without a dense warm-up are torch's ``fp16_compress_hook`` /
``bf16_compress_hook``: the same arithmetic without a Python call per bucket. The hook object then only counts
the steps and the bytes they send (``begin_step``) and keeps its checkpoint state.
- ``topk``: each worker adds its residual to its local gradient, keeps the ``k = ceil(ratio * n)``
  largest-magnitude entries, and all-gathers (value, index) pairs; the average of the sparse
  contributions is the result. With error feedback the entries not sent stay in the residual and
  are added again next step (Stich et al. 2018; Tencent's record used it between nodes).
- ``hierarchical_topk``: the bucket is first summed densely among the workers of one node (fast
  links); the node sum is cut into ``M`` chunks (M = workers per node) and the worker with local
  rank ``j`` sparsifies chunk ``j`` (plus its residual) and exchanges it only with the workers of
  local rank ``j`` on the other nodes; the averaged chunks are then all-gathered inside the node.
  So only ``k`` entries per chunk cross the slow network, and all ``M`` NICs/streams share the
  work. With one node nothing crosses the network and the bucket is reduced densely.
- ``powersgd``: torch's PowerSGD hook (rank ``comm.powersgd_rank``), for comparison.
- ``auto``: the hook runs its first ``AUTO_MEASURE_STEPS`` steps dense and measures, on this worker, the
  backward window the buckets arrive in (on the last of them: DDP rebuilds its buckets after the first
  step), the compression's and the half-precision casts' compute over the gradient's size;
  the ranks agree on the largest of each (one all-reduce), and at the first bucket of the next step the
  crossover model (``lightray.comm.auto``) picks dense, bf16 (fp16 where the GPU lacks bf16) or
  hierarchical top-k for ``comm.link_gbps`` and the node/worker layout, logged as the ``comm_auto``
  unit with its inputs and modelled step times. The choice is saved in the checkpoint and kept on
  resume while the worker set's layout is the same (a new worker adopts it from the others); a new
  layout decides again. Momentum correction, when asked for, is the hook's from the first step
  whichever mode is picked, so the optimizer's momentum never switches owner mid-run.

Deep Gradient Compression's accuracy units (``lightray.comm.dgc``; each off by default, each reported
at set-up through ``unit_log`` and in ``describe``/``stats``): momentum correction
(``comm.momentum_correction``: velocity, not gradient, goes into the residual; the hook then owns
momentum and the SGD optimizer runs with momentum 0, see ``optimizer_momentum``), local gradient
clipping (``comm.local_clip``), momentum-factor masking (``comm.momentum_masking``) and a sparsity
warm-up (``comm.sparsity_warmup_epochs``, driven by ``begin_step(epochs of samples seen)``). Selection
(``comm.selection``): exact ``torch.topk`` or a sampled threshold (``lightray.comm.compress``).

Overlap: through DDP every compressed bucket returns the future of its collective (flat top-k: the
all-gather; hierarchical: the closing all-gather inside the node), so backward goes on computing the
next buckets while it runs, as for dense. All hook state is read and written on the hook's thread
before the collective starts; completion callbacks only combine the received tensors.

No host syncs in the steady state (DESIGN.md): selection, packing, the residual and velocity updates and
local clipping run on tensors whose sizes depend on ``n`` and ``k`` only (``lightray.comm.compress``; index_add_
and ``torch.where`` instead of boolean masks; the clip factor a device tensor), and the counts that depend on
the data (clipped buckets, masked entries, selection misses) stay on the device until a report reads them.
``tests/test_comm_host_sync.py`` runs this compute on data-free "meta" tensors. What still waits for the
device: the first bucket after install/load (``_agree``), ``comm.mode=auto``'s one decision, the replayed
first step after a resume, and torch's own PowerSGD hook.

fp16 (``follow_loss_scale``, which the trainer calls with its GradScaler): residuals and velocities are
kept unscaled (divided by the loss scale S when written, multiplied when sent; exact, S being a power of
two), so a change of the scale changes nothing they deliver; a bucket that holds inf or nan on a rank is
sent as nan, so the overflow reaches every rank's averaged gradient and every rank's GradScaler skips the
step; and the slot tensors a step changed are restored on every rank when the scaler skipped it (their
values before are kept for one step and put back by ``torch.where`` on the scale's fall).

``comm.warmup_steps`` dense steps run before compression starts (top-k from step 0 hurts the early,
large gradients most). With a single worker nothing is communicated and every mode is the identity.

Residual storage (robust to DDP's bucket rebuild after the first iteration): the canonical form is
per parameter, keyed by the parameter's name; while a bucket's layout stays the same the hook keeps
that bucket's residual as one flat tensor (bucket index -> (parameter names, flat residual)). When
a bucket arrives whose parameter list differs from the cached one (DDP rebuilt its buckets), every
cached flat residual is split back into per-parameter tensors and the flat ones are rebuilt from
them, so no residual is ever applied to the wrong parameter. ``state_dict`` always writes the
per-parameter form.

Momentum-correction velocities use the same storage (per-parameter canonical form) and are saved,
loaded and dropped on a worker-set change together with the residuals.

Checkpoints: the state is per worker (each worker's residual is its own undelivered gradient), so
every rank saves its own ``state_dict()`` (e.g. ``comm_rank{rank}.pt``) and loads its own. The state is
tensors and plain values (PowerSGD's NumPy generator as its key array and counters), so it loads with
``weights_only=True``; it may be loaded to any device, and ``load_state_dict`` moves each tensor to the
hook's device (the selection generator's state to the CPU, where ``set_state`` wants it). The state also
holds DDP's bucket layouts of the last step: a fresh DDP runs its first iteration on its initial buckets
(all parameters in one, in torch 2.x) and rebuilds them only after it, so the first step after a resume
reduces that bucket as the saved buckets it is made of (``_replay_parts``), and top-k and PowerSGD select
over the same entries as without the restart. With the bucket size kept too (``lightray.comm.fusion``), a
resume at an unchanged layout continues the run uninterrupted exactly, in every mode.
Worker-count-change policy (``load_state_dict(sd, world_size)``): when the world size, the
node layout, the rank or the mode differ from the saved ones, the residuals are dropped (they are
undelivered gradient of workers that may not exist any more, scaled for another world size) and
the next ``comm.resize_dense_steps`` steps run dense, so the optimizer gets full gradients while the
new residuals build up; the step count is kept so the warm-up is not repeated.

Byte meter: ``bytes_sent`` counts the bytes this worker puts on the wire per the standard algorithms
(ring all-reduce: ``2 (W-1)/W * size``; all-gather: ``(W-1) * own payload``). ``bytes_inter_node``
counts the part that crosses nodes (for flat modes over several nodes, all of it: a ring's node-
crossing links carry the same volume as the others). ``dense_bytes`` is what dense fp32 would have
sent for the same buckets, so ``bytes_sent / dense_bytes`` is the achieved compression.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightray.comm import auto as comm_auto
from lightray.comm import powersgd
from lightray.comm.compress import HIGH, LOW, SelectionStats, k_for, pack, quantize, scatter_sum, select
from lightray.comm.dgc import accumulate_velocity, clip_factor, warmup_ratio
from lightray.comm.topology import Topology, build_groups
from lightray.comm.wire import allgather_bytes, done, ring_allreduce_bytes
from lightray.config import CommConfig
from lightray.units import unit_log

Layout = list[tuple[str, int]]  # (parameter name, numel) in bucket order

STATE_VERSION = 1
AUTO_CHOICES = ("dense", "fp16", "bf16", "hierarchical_topk")  # what comm.mode=auto can pick (codes 1..4)
AUTO_MEASURE_STEPS = 2  # dense steps comm.mode=auto measures before it decides


class SlotStore:
    """One kind of per-parameter hook state (residuals, velocities), robust to DDP's bucket rebuild.

    The canonical form is per parameter name; while a bucket's layout stays the same its state is one
    flat fp32 tensor (bucket index -> (layout, flat)). A bucket whose layout differs from the cached
    one (DDP rebuilt its buckets) sends every flat tensor back to per-parameter form first, so state
    is never applied to the wrong parameter.
    """

    def __init__(self) -> None:
        self._flat: dict[int, tuple[Layout, torch.Tensor]] = {}
        self._pending: dict[str, torch.Tensor] = {}

    def get(self, index: int, layout: Layout, n: int, device: torch.device,
            create: bool = True) -> torch.Tensor | None:
        """The flat state of bucket ``index`` (zeros where none is stored); None if ``create`` is off
        and nothing is stored for any of its parameters."""
        entry = self._flat.get(index)
        if entry is not None and entry[0] == layout and entry[1].numel() == n:
            return entry[1]
        if entry is not None:
            self._flush()
        if not create and not any(name in self._pending for name, _ in layout):
            return None
        parts = []
        for name, numel in layout:
            r = self._pending.pop(name, None)
            parts.append(r.reshape(-1).to(device=device, dtype=torch.float32) if r is not None and r.numel() == numel
                         else torch.zeros(numel, dtype=torch.float32, device=device))
        flat = torch.cat(parts) if parts else torch.zeros(n, dtype=torch.float32, device=device)
        self._flat[index] = (list(layout), flat)
        return flat

    def pop(self, index: int, layout: Layout, n: int, device: torch.device) -> torch.Tensor | None:
        """Take bucket ``index``'s state out of the store (None if there is none)."""
        t = self.get(index, layout, n, device, create=False)
        if t is not None:
            del self._flat[index]
        return t

    def _flush(self) -> None:
        for layout, flat in self._flat.values():
            for (name, _), piece in zip(layout, flat.split([nm for _, nm in layout])):
                self._pending[name] = piece.clone()
        self._flat.clear()

    def per_param(self) -> dict[str, torch.Tensor]:
        out = {k: v.detach().cpu().clone() for k, v in self._pending.items()}
        for layout, flat in self._flat.values():
            for (name, _), piece in zip(layout, flat.split([nm for _, nm in layout])):
                out[name] = piece.detach().cpu().clone()
        return out

    def load(self, per_param: dict[str, torch.Tensor], device: torch.device) -> None:
        """Take saved per-parameter state, wherever it was loaded, onto ``device`` (where the buckets live)."""
        self.clear()
        self._pending = {k: v.detach().to(device, copy=True) for k, v in per_param.items()}

    def clear(self) -> None:
        self._flat.clear()
        self._pending.clear()

    def __len__(self) -> int:
        return len(self._pending) + sum(len(layout) for layout, _ in self._flat.values())


SLOTS = ("residual", "momentum", "dense_momentum")


def _clock_mark(device: torch.device) -> Any:
    """A point in time to measure the backward window from: on CUDA an event recorded on the current stream
    (the host clock there would time the kernel launches, which run ahead of the GPU), else the host clock."""
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(device))
        return ev
    return time.perf_counter()


def _clock_span(first: Any, last: Any) -> float:
    """Seconds from mark ``first`` to mark ``last`` (waits for a CUDA event: only at the one-off decision)."""
    if isinstance(first, float):
        return last - first
    last.synchronize()
    return first.elapsed_time(last) / 1e3


class CommHook:
    """The DDP communication hook of one worker; see the module docstring for the modes."""

    def __init__(self, cfg: CommConfig, topology: Topology, device: torch.device, optimizer: str = "sgd",
                 nesterov: bool = False, timeout_s: float | None = None):
        self.cfg = cfg
        # Subgroups take torch's 30-minute default unless told: give them the main group's timeout.
        self.group_timeout = timedelta(seconds=timeout_s) if timeout_s else None
        self.topology = topology
        self.device = torch.device(device)
        self.auto = cfg.mode == "auto"
        self.mode = "dense" if self.auto else cfg.mode  # auto: dense until the first steps have been measured
        self.world_size = topology.world_size
        self._init_meters()
        self._force_dense = 0
        self._step_was_dense = False
        self._builtin: str | None = None  # set by install: the mode runs on DDP's own path (builtin_path)
        self._builtin_bytes = (0, 0)  # (sent, dense) bytes of one step's all-reduce on that path
        # residual: undelivered (velocity or gradient) of error feedback; momentum: local velocity u of
        # momentum correction on compressed steps; dense_momentum: the global velocity kept on dense
        # steps under momentum correction (identical on every rank), handed to ``momentum`` when
        # compression starts.
        self._slots = {name: SlotStore() for name in SLOTS}
        self._names_by_ptr: dict[int, str] = {}
        self._notes: list[str] = []
        self._prepared = False
        self._effective = self.mode
        self._init_groups()
        self._need_agree = True  # agree on step / forced dense steps at the first bucket (see _agree)
        self._psgd: Any = None
        self._psgd_pending: dict | None = None
        # DDP's bucket layouts: those of the step running (index -> layout), of the last finished step (saved
        # in the checkpoint), and, after a resume, the saved ones the first step replays (see _replay_parts).
        self._layouts_now: dict[int, Layout] = {}
        self._layouts_done: dict[int, Layout] = {}
        self._replay: dict[int, Layout] = {}
        self._replay_noted = False
        # DGC units (lightray.comm.dgc). Momentum correction replaces the optimizer's momentum, which only
        # works for plain SGD (LARS/LAMB scale the update per layer after their own momentum).
        sparse = cfg.mode in ("topk", "hierarchical_topk", "auto")
        self.momentum_correction = cfg.momentum_correction and sparse and optimizer == "sgd"
        self.nesterov = nesterov
        self.momentum = 0.0  # the schedule's momentum for this step (optimizer_momentum)
        self.epochs_done = 0.0  # epochs of samples seen, for the sparsity warm-up (begin_step)
        self.ratio_now = warmup_ratio(cfg.ratio, cfg.sparsity_warmup_start, cfg.sparsity_warmup_epochs, 0.0)
        # Counts that depend on the data stay on the device (read when reported): see ``clipped``, ``masked_entries``.
        self._clipped: int | torch.Tensor = 0  # bucket-steps whose local gradient was clipped
        self.clip_checks = 0
        self._masked: int | torch.Tensor = 0  # velocity entries zeroed by momentum-factor masking
        self.selection = SelectionStats()
        self._sel_gen = torch.Generator(device=self.device).manual_seed(1234 + topology.rank)
        self.bucket_timings: list[tuple[int, float, float]] | None = None  # (bucket, hook call, future done)
        self._init_auto()
        self._init_loss_scale()
        self.auto_evidence: dict[str, Any] | None = None
        if self.auto and self.world_size == 1:
            unit_log("comm_auto", "picked dense: a single worker communicates nothing", chosen="dense")
        self._unit_events(optimizer, sparse)
        if self.mode == "powersgd":
            self._psgd = powersgd.new_state(cfg)

    def _init_meters(self) -> None:
        """The step count and the byte and time meters that ``stats`` reports."""
        self.step = 0  # optimizer steps seen by the hook (a step ends with DDP's last bucket)
        self.bytes_sent = 0
        self.bytes_inter_node = 0
        self.dense_bytes = 0
        self.comm_seconds = 0.0  # wall time inside the hook's synchronous parts
        self.compressed_steps = 0
        self.dense_steps = 0

    def _init_groups(self) -> None:
        """The node and cross-node groups of hierarchical top-k, made at ``prepare``."""
        self._node_group: Any = None
        self._cross_group: Any = None
        self._node_size = 1
        self._num_nodes = 1
        self._node_chunk_of_member: list[int] = []
        self._local_index = 0

    def _init_auto(self) -> None:
        """``comm.mode=auto``'s measurement of the first dense steps."""
        # comm.mode=auto: pending until decided; what the measured step saw (bucket calls, elements, buckets)
        self._auto_pending = self.auto and self.world_size > 1
        self._auto_hier_ready = False
        # Marks (_clock_mark) of the first and last bucket of the step being measured, and of the last one measured.
        self._auto_first: Any = None
        self._auto_last: Any = None
        self._auto_elements = self._auto_buckets = self._auto_steps = 0
        self._auto_window: tuple[Any, Any] | None = None

    def _init_loss_scale(self) -> None:
        """fp16 loss scaling's view of the hook's state (``follow_loss_scale``)."""
        # fp16 loss scaling (follow_loss_scale): the scaler, this step's scale S and 1/S (device tensors), and the
        # journal of slot tensors this step changed, each with its value before (settled at the next step).
        self._scaler: Any = None
        self._scale_t: torch.Tensor | None = None
        self._unscale_t: torch.Tensor | None = None
        self._journal: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._journal_scale: torch.Tensor | None = None
        self._new_step = True

    def _unit_events(self, optimizer: str, sparse: bool) -> None:
        """One unit event per DGC unit at set-up: on, off, or not applicable to this mode/optimizer."""
        c = self.cfg
        na = None if sparse else f"not applicable to comm.mode={c.mode}"
        if self.momentum_correction:
            mc = (f"on: the hook accumulates velocity (momentum from the schedule, nesterov={self.nesterov}); "
                  "the SGD optimizer runs with momentum 0")
        elif c.momentum_correction and sparse:
            mc = f"off: optimizer {optimizer!r} keeps its own momentum (momentum correction needs sgd)"
        else:
            mc = na or "off (comm.momentum_correction=false)"
        unit_log("momentum_correction", mc, on=self.momentum_correction)
        unit_log("local_clip", na or (f"on: local bucket gradients clipped to {c.local_clip:g}/sqrt(world)"
                                      if c.local_clip > 0 else "off (comm.local_clip=0)"),
                 on=bool(sparse and c.local_clip > 0))
        masking = sparse and c.momentum_masking and self.momentum_correction
        unit_log("momentum_masking", na or ("on: velocity zeroed where entries were sent" if masking else
                                            "off (needs comm.momentum_masking and momentum correction)"), on=masking)
        warm = sparse and c.sparsity_warmup_epochs > 0 and c.sparsity_warmup_start > c.ratio
        unit_log("sparsity_warmup", na or (f"on: ratio {c.sparsity_warmup_start:g} -> {c.ratio:g} exponentially "
                                           f"over {c.sparsity_warmup_epochs:g} epoch(s) of samples seen" if warm
                                           else "off (comm.sparsity_warmup_epochs=0 or start <= ratio)"), on=warm)
        unit_log("topk_selection", na or f"{c.selection} top-k {'per parameter' if c.per_layer else 'per bucket'}",
                 method=c.selection, per_layer=c.per_layer)
        unit_log("topk_payload", na or ("compact: fp16 values (rounding error kept in the residual) and 16-bit "
                                        "block offsets of the sorted indices, 4 bytes an entry"
                                        if c.payload == "compact" else "fp32: fp32 values and int32 indices, "
                                        "8 bytes an entry"), payload=c.payload)

    def follow_loss_scale(self, scaler: torch.amp.GradScaler | None) -> None:
        """Follow ``scaler``'s loss scale (fp16): residuals and velocities are kept unscaled, and a step the
        scaler skips for an overflow leaves them as they were. A disabled scaler (bf16, fp32) is ignored.

        The hook holds the scaler, not a number: ``get_scale()`` returns a float, which waits for the device
        at every step, and the scale tensor itself does not exist until the first ``scaler.scale(loss)``. The
        hook reads the scaler's ``_scale`` tensor at each step's first bucket (after ``scale(loss)``, before
        ``update()``), on the device, without a host read.

        Why unscaled: the scale changes (halved at an overflow, doubled every ``growth_interval`` steps), and a
        residual written at one scale and sent at another would be delivered that many times too large or too
        small. ``S`` is a power of two, so dividing by it on write and multiplying on read are exact.

        Why the journal: the scaler skips a step when the *averaged* gradient holds inf or nan. A bucket with an
        overflow on one rank is sent as nan (``_sparsify``), so every rank's scaler sees it; but the other ranks,
        and the other buckets, updated their residuals for a step that then never happened. Which step was
        skipped is known only after ``scaler.update()``: it lowered the scale (its backoff factor is < 1, and it
        backs off exactly when it skipped). So each slot tensor a step changes is copied first, and at the next
        step's first bucket ``torch.where(scale now < scale then, copy, value)`` puts back the copies of a
        skipped step, on the device.
        """
        self._scaler = scaler if scaler is not None and scaler.is_enabled() else None

    @property
    def clipped(self) -> int:
        """Bucket-steps whose local gradient was clipped (reads the device: for reports)."""
        return int(self._clipped)

    @property
    def masked_entries(self) -> int:
        """Velocity entries zeroed by momentum-factor masking (reads the device: for reports)."""
        return int(self._masked)

    def optimizer_momentum(self, momentum: float) -> float:
        """Record the schedule's momentum for this step; return the momentum the optimizer should use.

        With momentum correction the hook applies momentum itself, on every step (dense warm-up steps
        keep a global velocity, compressed steps each worker's local one), and returns the averaged
        velocity: the optimizer must then run plain SGD (momentum 0), or momentum would be applied twice.
        Returning 0 on every step, not only on compressed ones, keeps the optimizer's own momentum
        buffer empty, so no stale buffer resurfaces when steps switch between dense and compressed.
        Weight decay stays in the optimizer and so acts on the weights without momentum.
        """
        self.momentum = float(momentum)
        return 0.0 if self.momentum_correction else float(momentum)

    def begin_step(self, epochs_done: float) -> None:
        """Tell the hook how many epochs of samples have been seen (drives the sparsity warm-up). On a built-in
        path (no hook call per bucket) this counts the step and the bytes its all-reduce sends."""
        if self._builtin is not None:
            self.step += 1
            self.dense_steps += 1
            self.bytes_sent += self._builtin_bytes[0]
            self.dense_bytes += self._builtin_bytes[1]
            if self.topology.num_nodes > 1:
                self.bytes_inter_node += self._builtin_bytes[0]
        self.epochs_done = float(epochs_done)
        c = self.cfg
        self.ratio_now = warmup_ratio(c.ratio, c.sparsity_warmup_start, c.sparsity_warmup_epochs, self.epochs_done)

    # --- set-up ------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Create the process groups the mode needs (a collective: every rank calls it). Idempotent."""
        if self._prepared:
            return
        self._prepared = True
        if self.world_size == 1:
            self._effective = "identity"
            self._notes.append("single worker: nothing to communicate")
            return
        if self.mode != "hierarchical_topk" and not self.auto:
            return
        node_groups, cross_groups = build_groups(self.topology)
        sizes = {len(g) for g in node_groups}
        # Every rank creates every group in the same order, as new_group requires.
        made_nodes = [dist.new_group(g, timeout=self.group_timeout) for g in node_groups]
        made_cross = [dist.new_group(g, timeout=self.group_timeout) for g in cross_groups]
        rank = dist.get_rank()
        placement_local = {}
        for g in cross_groups:
            for r in g:
                placement_local[r] = cross_groups.index(g)
        if len(sizes) != 1 or any(sorted(placement_local[r] for r in g) != list(range(len(g))) for g in node_groups):
            if self.auto:
                self._notes.append("auto: nodes hold different worker counts: hierarchical top-k is no candidate")
                return
            self._effective = "topk"
            self._notes.append(f"nodes hold different worker counts {sorted(len(g) for g in node_groups)}: "
                               "hierarchical top-k falls back to flat top-k")
            return
        self._num_nodes = len(node_groups)
        self._node_size = sizes.pop()
        if self._num_nodes == 1:
            if self.auto:
                self._notes.append("auto: one node: hierarchical top-k would reduce densely, no candidate")
                return
            self._effective = "dense"
            self._notes.append("one node: nothing crosses the network, buckets are reduced densely")
            return
        for g, pg in zip(node_groups, made_nodes):
            if rank in g:
                self._node_group = pg
                self._node_chunk_of_member = [placement_local[r] for r in g]  # g is sorted like the group
        for g, pg in zip(cross_groups, made_cross):
            if rank in g:
                self._cross_group = pg
        self._local_index = placement_local[rank]
        self._auto_hier_ready = True

    def builtin_path(self) -> str | None:
        """The DDP path that does this mode's work without lightray's hook, or None where a lightray unit needs the
        bucket: auto (it measures the buckets), the sparse modes and PowerSGD (residuals, selection), a dense
        warm-up before fp16/bf16 (the bucket's precision changes mid-run), one worker (the identity: nothing to
        send) and ``comm.builtin=false``."""
        if not self.cfg.builtin or self.auto or self.world_size == 1:
            return None
        if self.mode == "dense":
            return "DDP's own all-reduce"
        if self.mode in ("fp16", "bf16") and self.cfg.warmup_steps == 0:
            return f"torch's {self.mode}_compress_hook"
        return None

    def install(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Register this hook on ``ddp_model`` (a collective for hierarchical_topk), or DDP's own path for the
        mode (:meth:`builtin_path`), said as the ``comm_path`` unit."""
        module = ddp_model.module
        self._names_by_ptr = {p.data_ptr(): n for n, p in module.named_parameters() if p.requires_grad}
        self.prepare()
        path = self.builtin_path()
        if path is None:
            ddp_model.register_comm_hook(self, _ddp_hook)
            unit_log("comm_path", f"lightray's comm hook for every bucket (mode {self.mode})", builtin=False)
            return
        self._builtin = path
        n = sum(p.numel() for p in module.parameters() if p.requires_grad)
        width = 4 if self.mode == "dense" else 2
        self._builtin_bytes = (ring_allreduce_bytes(n * width, self.world_size),
                               ring_allreduce_bytes(n * 4, self.world_size))
        if self.mode != "dense":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = default_hooks.fp16_compress_hook if self.mode == "fp16" else default_hooks.bf16_compress_hook
            ddp_model.register_comm_hook(None, hook)  # None: the default process group
        unit_log("comm_path", f"{self.mode} through {path}: no lightray unit needs the bucket, so no Python call "
                              "per bucket (comm.builtin=false keeps lightray's hook)", builtin=True, path=path)

    # --- per step ---------------------------------------------------------------------------
    def _agree(self, device: torch.device) -> None:
        """Make every rank take the same dense/compressed decisions from here on (one tiny all-reduce).

        After a resume the ranks may disagree: a worker added by an elastic resize has no saved
        state (step 0, still in warm-up), the others have theirs. Mismatched collectives would hang,
        so at the first bucket after install/load every rank adopts the largest step count and
        forced-dense count (and PowerSGD iteration).
        """
        self._need_agree = False
        if self.world_size == 1:
            return
        vals = [self.step, self._force_dense, self._psgd.iter if self._psgd is not None else 0, self._auto_code()]
        t = torch.tensor(vals, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        self.step, self._force_dense = int(t[0]), int(t[1])
        if self._psgd is not None:
            self._psgd.iter = int(t[2])
        if self._auto_pending and int(t[3]) > 0:  # a worker without the saved choice takes the others'
            choice = AUTO_CHOICES[int(t[3]) - 1]
            self._apply_auto(choice)
            self._notes.append(f"auto: {choice} adopted from the other workers' checkpoints")
            unit_log("comm_auto", f"kept {choice} from the other workers' checkpoints", chosen=choice)

    # --- comm.mode=auto ------------------------------------------------------------------------
    def _auto_code(self) -> int:
        return 0 if not self.auto or self._auto_pending else AUTO_CHOICES.index(self.mode) + 1

    def _apply_auto(self, mode: str) -> None:
        if mode == "hierarchical_topk":
            self.prepare()  # a no-op after install; a hook loaded before it builds its groups here
        if mode == "hierarchical_topk" and not self._auto_hier_ready:
            raise RuntimeError("comm.mode=auto: hierarchical_topk picked without its process groups")
        self.mode = self._effective = mode
        self._auto_pending = False

    def _auto_tick(self, n: int, device: torch.device) -> None:
        """Record a bucket of the measured step; at the first bucket after it, decide."""
        if self._auto_steps >= AUTO_MEASURE_STEPS and self._auto_first is None:
            self._auto_decide(device)
            return
        now = _clock_mark(device)
        if self._auto_first is None:
            self._auto_first, self._auto_elements, self._auto_buckets = now, 0, 0
        self._auto_last = now
        self._auto_elements += n
        self._auto_buckets += 1

    def _auto_decide(self, device: torch.device) -> None:
        """Measure the compression and cast compute, agree on the inputs, pick the mode (a collective)."""
        c, n = self.cfg, self._auto_elements
        half = comm_auto.half_mode(device)
        compress = comm_auto.time_compression(n, c.ratio, c.selection, device, payload=c.payload)
        cast = comm_auto.time_cast(n, torch.float16 if half == "fp16" else torch.bfloat16, device)
        window = _clock_span(*self._auto_window) if self._auto_window is not None else 0.0
        t = torch.tensor([compress, cast, window], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # every rank decides on the same inputs, so the same way
        costs = comm_auto.StepCosts(elements=n, buckets=self._auto_buckets, ratio=c.ratio, compress_s=float(t[0]),
                                    cast_s=float(t[1]), overlap_s=float(t[2]), payload=c.payload)
        cluster = comm_auto.Cluster(self.topology.num_nodes, self.topology.local_world_size, c.link_gbps,
                                    comm_auto.INTRA_GBPS.get(device.type, comm_auto.INTRA_GBPS["cpu"]))
        candidates = [half, *(["hierarchical_topk"] if self._auto_hier_ready else [])]
        mode, why, evidence = comm_auto.choose(cluster, costs, candidates)
        self._apply_auto(mode)
        self.auto_evidence = evidence
        self._notes.append(f"auto: {why}")
        unit_log("comm_auto", why, chosen=mode, link_gbps=c.link_gbps, candidates=candidates,
                 modes={m: r["step_s"] for m, r in evidence["modes"].items()})

    def _dense_now(self) -> bool:
        return self.mode == "dense" or self.step < self.cfg.warmup_steps or self._force_dense > 0

    def _end_step(self) -> None:
        if self._layouts_now:
            self._layouts_done, self._layouts_now = self._layouts_now, {}
        self._replay = {}  # one step replays the saved layouts; DDP has rebuilt its buckets by the next
        if self._auto_pending and self._auto_first is not None:
            # backward from the first bucket to the last; measured when deciding (a CUDA event's time waits for it)
            self._auto_window = (self._auto_first, self._auto_last)
            self._auto_first = None
            self._auto_steps += 1
        self._new_step = True
        if self._step_was_dense:
            self.dense_steps += 1
            if self._force_dense > 0 and self.step >= self.cfg.warmup_steps:
                self._force_dense -= 1
        else:
            self.compressed_steps += 1
        self.step += 1

    def _layout(self, bucket: dist.GradBucket) -> Layout:
        buf = bucket.buffer()
        params = bucket.parameters()
        layout = [(self._names_by_ptr.get(p.data_ptr(), f"bucket{bucket.index()}.param{i}"), p.numel())
                  for i, p in enumerate(params)]
        if sum(n for _, n in layout) != buf.numel():
            # A layout we cannot map onto parameters (padding, sparse grads): key by bucket index.
            layout = [(f"bucket{bucket.index()}", buf.numel())]
        return layout

    def _replay_parts(self, index: int, layout: Layout) -> list[tuple[int, Layout]] | None:
        """The saved buckets (index, layout) that bucket ``index`` of this step is made of, when it is not itself
        a saved one; None when it is, or when the saved buckets do not tile it.

        A fresh DDP runs its first iteration on its initial buckets (one bucket of every parameter, in torch
        2.x) and rebuilds them in gradient-ready order only after it, so the first step after a resume would
        select over other entries than the same step of the run uninterrupted. Replaying the saved layout for
        that step keeps the selection, the residual keys and PowerSGD's per-bucket memories as they were."""
        if self._replay.get(index) == layout:
            return None
        mine = dict(layout)
        parts = [(i, sub) for i, sub in sorted(self._replay.items())
                 if sub and all(mine.get(name) == numel for name, numel in sub)]
        covered = [name for _, sub in parts for name, _ in sub]
        if len(covered) != len(mine) or set(covered) != set(mine):
            return None
        return parts

    def aggregate(self, buffer: torch.Tensor, layout: Layout, bucket_index: int = 0,
                  last: bool = True) -> torch.Tensor:
        """Synchronously average ``buffer`` (this worker's local gradients) across workers.

        The same computation the DDP hook runs for one bucket; public so it can be checked on known
        tensors without DDP. ``last`` marks the last bucket of a step. Not for powersgd.
        """
        if self.mode == "powersgd":
            raise ValueError("CommHook.aggregate: mode 'powersgd' runs only through DDP (install)")
        self.prepare()
        if layout and sum(n for _, n in layout) != buffer.numel():
            raise ValueError(f"CommHook.aggregate: layout covers {sum(n for _, n in layout)} elements, "
                             f"buffer has {buffer.numel()}")
        t0 = time.perf_counter()
        out = self._reduce(buffer, layout, bucket_index, sync=True)
        assert isinstance(out, torch.Tensor)
        self.comm_seconds += time.perf_counter() - t0
        if last:
            self._end_step()
        return out

    def _reduce(self, buf: torch.Tensor, layout: Layout, index: int, sync: bool) -> torch.Tensor | torch.futures.Future:
        world = self.world_size
        n = buf.numel()
        if self._new_step:
            self._begin_step()
        if self._need_agree:
            self._agree(buf.device)
        if self._auto_pending:
            self._auto_tick(n, buf.device)
        self.dense_bytes += ring_allreduce_bytes(n * 4, world)
        self._step_was_dense = False
        if self._effective == "identity":
            self._step_was_dense = True
            out = self._dense_velocity(buf, layout, index)(buf) if self.momentum_correction else buf
            return out if sync else done(out)
        if self._dense_now() or self._effective == "dense":
            self._step_was_dense = True
            post = self._dense_velocity(buf, layout, index) if self.momentum_correction else None
            return self._dense(buf, torch.float32 if buf.dtype == torch.float32 else buf.dtype, sync, post)
        if self.mode in ("fp16", "bf16"):
            # (momentum correction here only under auto, which may pick a half-precision mode)
            post = self._dense_velocity(buf, layout, index) if self.momentum_correction else None
            return self._dense(buf, torch.float16 if self.mode == "fp16" else torch.bfloat16, sync, post)
        if self._effective == "topk":
            return self._topk(buf, layout, index, sync)
        return self._hierarchical(buf, layout, index, sync)

    def _dense_velocity(self, buf: torch.Tensor, layout: Layout, index: int) -> Any:
        """Momentum correction on a dense step: a function from the averaged gradient to the velocity update.

        Every rank holds the same global velocity (it is built from the same mean), so the first compressed
        step can hand it to each worker's local velocity without communication (``_local_velocity``). The
        velocity is looked up now, on the hook's thread; the returned function runs in the collective's
        completion callback, where touching the slot store could race with the next bucket's lookup.
        """
        u = self._slots["dense_momentum"].get(index, layout, buf.numel(), buf.device)
        self._journal_add(u)
        momentum, nesterov, scale, unscale = self.momentum, self.nesterov, self._scale_t, self._unscale_t

        def post(mean: torch.Tensor) -> torch.Tensor:
            g = mean.float() if unscale is None else mean.float() * unscale  # the velocity is kept unscaled
            out = accumulate_velocity(u, g, momentum, nesterov)
            return (out if scale is None else out * scale).to(mean.dtype)

        return post

    def _local_velocity(self, index: int, layout: Layout, n: int, device: torch.device,
                        scale: float) -> torch.Tensor:
        """This worker's velocity for a compressed step; on the first one it starts from the dense steps'
        global velocity times ``scale`` (chosen so that the workers' contributions average to it)."""
        store = self._slots["momentum"]
        u = store.get(index, layout, n, device, create=False)
        if u is not None:
            return u
        u = store.get(index, layout, n, device)
        assert u is not None
        glob = self._slots["dense_momentum"].pop(index, layout, n, device)
        if glob is not None:
            u.copy_(glob).mul_(scale)
        return u

    def _dense(self, buf: torch.Tensor, dtype: torch.dtype, sync: bool,
               post: Any = None) -> torch.Tensor | torch.futures.Future:
        world = self.world_size
        # Divide first (as torch's fp16 hook does) so half-precision sums cannot overflow.
        send = buf.div(world) if dtype == buf.dtype else buf.to(dtype).div_(world)
        nbytes = ring_allreduce_bytes(send.numel() * send.element_size(), world)
        self.bytes_sent += nbytes
        if self.topology.num_nodes > 1:
            self.bytes_inter_node += nbytes
        if sync:
            dist.all_reduce(send)
            out = send.to(buf.dtype)
            return post(out) if post is not None else out
        fut = dist.all_reduce(send, async_op=True).get_future()

        def finish(f: torch.futures.Future) -> torch.Tensor:
            res = f.value()[0]
            if post is not None:
                return post(res.to(buf.dtype))
            if res.dtype != buf.dtype:
                buf.copy_(res)
                return buf
            return res

        return fut.then(finish)

    def _accumulate(self, g: torch.Tensor, index: int, layout: Layout, n: int, lo: int, hi: int,
                    velocity_scale: float) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """DGC's accumulation for entries [lo, hi) of a bucket: (what to sparsify, residual, velocity).

        ``g`` is the local gradient of those entries (flat topk: the worker's bucket; hierarchical: its
        node's sum over its chunk). Clipping, then velocity (momentum correction), then the residual.
        """
        c = self.cfg
        coef = self._unscale_t  # 1/S under fp16 loss scaling: the state is kept unscaled (follow_loss_scale)
        if c.local_clip > 0:
            self.clip_checks += 1
            factor, clipped = clip_factor(g, c.local_clip, self.world_size, coef)
            self._clipped = self._clipped + clipped.long()
            coef = factor if coef is None else factor * coef
        if coef is not None:
            g = g * coef
        u = None
        acc = g
        if self.momentum_correction:
            u = self._local_velocity(index, layout, n, g.device, velocity_scale)[lo:hi]
            self._journal_add(u)
            acc = accumulate_velocity(u, g, self.momentum, self.nesterov)
        residual = None
        if c.error_feedback:
            # Accumulate in place: the residual becomes the accumulator, and _sparsify zeroes what it sends
            # (one pass over the bucket fewer than a separate sum and copy-back).
            residual = self._residual(index, layout, n, g.device)[lo:hi]
            self._journal_add(residual)
            acc = residual.add_(acc)
        return acc, residual, u

    def _select(self, acc: torch.Tensor, segments: list[int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(indices to send, None or a mask of the real ones): the top ``ratio`` of the whole of ``acc``, or,
        with ``segments`` (per-parameter sizes, ``comm.per_layer``), of each parameter, as DGC selects per
        layer so that a layer of small gradients is not starved by a layer of large ones in one bucket.
        Padding entries (value 0, at their part's first index) fill up where the sampled selection found fewer;
        the mask is built on the device from the padding counts, which are never read on the host."""
        mag = acc.abs()
        parts = [(0, acc.numel())]
        if segments:
            offs = [0, *itertools.accumulate(segments)]
            parts = list(zip(offs[:-1], segments))
        idxs, pads = [], []
        for off, size in parts:
            kk = k_for(self.ratio_now, size)
            i, pad = select(mag[off:off + size] if segments else mag, kk, self.cfg.selection, self._sel_gen,
                            self.selection)
            idxs.append(i + off if off else i)
            pads.append((kk, pad))
        idx = idxs[0] if len(idxs) == 1 else torch.cat(idxs)
        if all(pad is None for _, pad in pads):
            return idx, None
        real = torch.cat([torch.arange(kk, device=acc.device) < kk - pad if pad is not None
                          else torch.ones(kk, dtype=torch.bool, device=acc.device) for kk, pad in pads])
        return idx, real

    def _sparsify(self, acc: torch.Tensor, residual: torch.Tensor | None,
                  velocity: torch.Tensor | None = None, segments: list[int] | None = None) -> tuple[torch.Tensor, int]:
        """Pack the top-k of ``acc`` per ``comm.payload`` (``lightray.comm.compress.pack``); updates ``residual``
        (and, with momentum masking, ``velocity``) in place at the sent indices: with the compact payload the
        residual keeps each sent value's fp16 rounding error, so residual + sent equals ``acc`` exactly.

        Under fp16 loss scaling ``acc`` is unscaled and the values are scaled by S for the wire (fp16's range is
        what the loss scale is for). A bucket holding inf or nan goes out as nan in every value, whichever
        entries were selected, so that every rank's averaged gradient shows the overflow to its GradScaler.
        No host read anywhere: fixed-size tensors, ``torch.where`` and index_add_ instead of masks."""
        finite = torch.isfinite(acc).all()  # before the residual (which may be acc) changes below
        idx, real = self._select(acc, segments)
        k = idx.numel()
        payload = self.cfg.payload
        vals = acc[idx].float()
        wire = vals if self._scale_t is None else vals * self._scale_t
        if real is not None:
            wire = torch.where(real, wire, 0.0)
        sent = quantize(wire, payload)
        if residual is not None:
            if residual is not acc:
                residual.copy_(acc)
            # acc - sent at the sent indices: 0 for the fp32 payload, the rounding error for the compact one;
            # padding (value 0) adds nothing, also where its index is a real entry's.
            back = sent if self._unscale_t is None else sent * self._unscale_t
            residual.index_add_(0, idx, back.neg())
        if velocity is not None and self.cfg.momentum_masking:
            drop = velocity[idx].neg()
            velocity.index_add_(0, idx, drop if real is None else torch.where(real, drop, 0.0))
            self._masked = self._masked + (k if real is None else real.sum())
        sent = torch.where(finite, sent, math.nan)
        return pack(sent, idx, acc.numel(), payload), k

    def _scatter_sum(self, parts: list[torch.Tensor], k: int, n: int, device: torch.device) -> torch.Tensor:
        return scatter_sum(parts, k, n, self.cfg.payload, device)

    def _gather(self, packed: torch.Tensor, size: int, group: Any, sync: bool,
                finish: Any) -> torch.Tensor | torch.futures.Future:
        """All-gather ``packed`` and return ``finish(parts)``; asynchronously (a future) unless ``sync``, so
        DDP's backward goes on computing while the collective runs, as it does for dense buckets."""
        parts = [torch.empty_like(packed) for _ in range(size)]
        if sync:
            dist.all_gather(parts, packed, group=group)
            return finish(parts)
        fut = dist.all_gather(parts, packed, group=group, async_op=True).get_future()

        def done(f: torch.futures.Future) -> torch.Tensor:
            f.wait()  # re-raises a failed collective instead of finishing on unfilled buffers
            return finish(parts)

        return fut.then(done)

    def _topk(self, buf: torch.Tensor, layout: Layout, index: int, sync: bool) -> torch.Tensor | torch.futures.Future:
        world, n = self.world_size, buf.numel()
        acc, residual, u = self._accumulate(buf.float(), index, layout, n, 0, n, 1.0)
        segments = [numel for _, numel in layout] if self.cfg.per_layer and len(layout) > 1 else None
        packed, k = self._sparsify(acc, residual, u, segments)
        nbytes = allgather_bytes(packed.numel() * packed.element_size(), world)
        self.bytes_sent += nbytes
        if self.topology.num_nodes > 1:
            self.bytes_inter_node += nbytes
        def finish(parts: list[torch.Tensor]) -> torch.Tensor:
            return self._scatter_sum(parts, k, n, buf.device).div_(world).to(buf.dtype)

        return self._gather(packed, world, None, sync, finish)

    def _hierarchical(self, buf: torch.Tensor, layout: Layout, index: int,
                      sync: bool) -> torch.Tensor | torch.futures.Future:
        world, m, nodes = self.world_size, self._node_size, self._num_nodes
        n = buf.numel()
        node_sum = buf.float().clone()
        # The node sum and the cross-node exchange are synchronous (each feeds the next step of this
        # bucket); the closing all-gather inside the node runs asynchronously unless ``sync``.
        dist.all_reduce(node_sum, group=self._node_group)
        self.bytes_sent += ring_allreduce_bytes(n * 4, m)
        c = math.ceil(n / m)
        lo, hi = min(n, self._local_index * c), min(n, (self._local_index + 1) * c)
        padded = torch.zeros(c, dtype=torch.float32, device=buf.device)
        if hi > lo:  # all members of a cross group share local index, hence the same chunk length
            # Each node's velocity is built from its node sum; M times the global velocity per node makes
            # the nodes' contributions, divided by the world size, average to it.
            acc, residual, u = self._accumulate(node_sum[lo:hi], index, layout, n, lo, hi, float(m))
            packed, k = self._sparsify(acc, residual, u)
            parts = [torch.empty_like(packed) for _ in range(nodes)]
            dist.all_gather(parts, packed, group=self._cross_group)
            nbytes = allgather_bytes(packed.numel() * packed.element_size(), nodes)
            self.bytes_sent += nbytes
            self.bytes_inter_node += nbytes
            padded[: hi - lo] = self._scatter_sum(parts, k, hi - lo, buf.device).div_(world)
        self.bytes_sent += allgather_bytes(c * 4, m)

        def finish(chunks: list[torch.Tensor]) -> torch.Tensor:
            ordered = [chunks[self._node_chunk_of_member.index(j)] for j in range(m)]
            return torch.cat(ordered)[:n].to(buf.dtype)

        return self._gather(padded, m, self._node_group, sync, finish)

    # --- per-parameter state (residuals, velocities) ----------------------------------------------
    def _residual(self, index: int, layout: Layout, n: int, device: torch.device) -> torch.Tensor:
        return self._slots["residual"].get(index, layout, n, device)

    def residuals(self) -> dict[str, torch.Tensor]:
        """Per-parameter residuals (flat, fp32, on CPU, unscaled under fp16 loss scaling), keyed by parameter
        name; as the loss scaler's decision on the last step leaves them (see ``_as_decided``)."""
        with self._as_decided():
            return self._slots["residual"].per_param()

    def velocities(self) -> dict[str, torch.Tensor]:
        """Per-parameter local velocities of momentum correction (flat, fp32, on CPU, unscaled like residuals)."""
        with self._as_decided():
            return self._slots["momentum"].per_param()

    # --- fp16 loss scaling (follow_loss_scale) ------------------------------------------------------
    def _scaler_scale(self) -> torch.Tensor | None:
        return None if self._scaler is None else getattr(self._scaler, "_scale", None)

    def _begin_step(self) -> None:
        """At a step's first bucket: settle the last step's journal, take this step's loss scale."""
        self._new_step = False
        now = self._scaler_scale()
        self._settle(now)
        if now is None:
            self._scale_t = self._unscale_t = None
            return
        self._scale_t = now.clone()  # the scaler's tensor changes in place at update()
        self._unscale_t = self._scale_t.reciprocal()
        self._journal_scale = self._scale_t

    def _journal_add(self, t: torch.Tensor) -> None:
        """Keep ``t``'s value before this step changes it in place (only under loss scaling: only then can a step
        be skipped)."""
        if self._scale_t is not None:
            self._journal.append((t, t.clone()))

    def _skipped(self, now: torch.Tensor | None) -> torch.Tensor | None:
        """Whether the scaler skipped the journal's step (a 0-d bool on the device), None when it cannot say."""
        if not self._journal or now is None or self._journal_scale is None:
            return None
        return now < self._journal_scale

    def _settle(self, now: torch.Tensor | None) -> None:
        skipped = self._skipped(now)
        if skipped is not None:
            for live, before in reversed(self._journal):  # reversed: a tensor changed twice gets its first copy
                torch.where(skipped, before, live, out=live)
        self._journal = []

    @contextlib.contextmanager
    def _as_decided(self) -> Iterator[None]:
        """The slot state as the scaler's decision on the last step leaves it, without settling it: read before
        ``scaler.update()``, the step still counts; the next step's first bucket settles it for good."""
        skipped = self._skipped(self._scaler_scale())
        if skipped is None:
            yield
            return
        kept = [live.clone() for live, _ in self._journal]
        for live, before in reversed(self._journal):
            torch.where(skipped, before, live, out=live)
        try:
            yield
        finally:
            for (live, _), value in zip(self._journal, kept):
                live.copy_(value)

    # --- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This worker's state: residuals per parameter name, step count, byte counters, topology."""
        with self._as_decided():
            return self._state_dict()

    def _state_dict(self) -> dict:
        sd: dict[str, Any] = {
            "version": STATE_VERSION, "mode": self.mode, "rank": self.topology.rank,
            "world_size": self.world_size, "num_nodes": self.topology.num_nodes,
            "local_world_size": self.topology.local_world_size, "step": self.step,
            "bytes_sent": self.bytes_sent, "bytes_inter_node": self.bytes_inter_node,
            "dense_bytes": self.dense_bytes, "dense_steps": self.dense_steps,
            "compressed_steps": self.compressed_steps, "force_dense": self._force_dense,
            "residuals": self.residuals(), "powersgd": None, "momentum": self.velocities(),
            "dense_momentum": self._slots["dense_momentum"].per_param(),
            "selection_rng": self._sel_gen.get_state().cpu(),
            "selection_rng_device": self.device.type,  # its state's shape depends on it (16 bytes on CUDA)
            "auto_choice": self.mode if self.auto and not self._auto_pending else None,
            "bucket_layouts": {i: [[name, numel] for name, numel in layout]
                               for i, layout in sorted(self._layouts_done.items())},
            "residual_units": "unscaled",  # by the fp16 loss scale (older states kept them scaled)
        }
        if self._psgd is not None:
            sd["powersgd"] = powersgd.state_dict(self._psgd)
        return sd

    def load_state_dict(self, sd: dict, world_size: int) -> None:
        """Restore this worker's state; drop residuals when the worker set changed (module docstring)."""
        _check_state(sd)
        self.step = int(sd["step"])
        for meter in ("bytes_sent", "bytes_inter_node", "dense_bytes", "dense_steps", "compressed_steps"):
            setattr(self, meter, int(sd.get(meter, 0)))
        vel_saved = bool(sd.get("momentum") or sd.get("dense_momentum"))
        for store in self._slots.values():
            store.clear()
        self._journal, self._new_step = [], True  # the journal's tensors belonged to the state just replaced
        changes = []
        if int(sd["world_size"]) != world_size:
            changes.append(f"world size {sd['world_size']} -> {world_size}")
        if (sd.get("num_nodes"), sd.get("local_world_size")) != (self.topology.num_nodes,
                                                                 self.topology.local_world_size):
            changes.append(f"layout {sd.get('num_nodes')}x{sd.get('local_world_size')} -> "
                           f"{self.topology.num_nodes}x{self.topology.local_world_size}")
        if self.auto and self._auto_pending and sd.get("auto_choice") in AUTO_CHOICES and not changes:
            # The same layout: keep the run's choice (deciding again could flip the mode and drop residuals).
            self._apply_auto(sd["auto_choice"])
            self._notes.append(f"auto: {self.mode} kept from the checkpoint")
            unit_log("comm_auto", f"kept {self.mode} from the checkpoint (same worker layout)", chosen=self.mode)
        if int(sd["rank"]) != self.topology.rank:
            changes.append(f"state of rank {sd['rank']} loaded on rank {self.topology.rank}")
        if self._scaler is not None and sd.get("residual_units") != "unscaled" and (sd["residuals"] or vel_saved):
            # saved times the loss scale of their step, which the hook cannot know: sent as they are, they would
            # be that many times too large
            changes.append("residuals saved loss-scaled by an older version")
        if sd["mode"] != self.mode:
            changes.append(f"mode {sd['mode']} -> {self.mode}")
        self._need_agree = True
        if changes:
            self._force_dense = self.cfg.resize_dense_steps if self.mode != "dense" else 0
            vel = len(sd.get("momentum") or {}) + len(sd.get("dense_momentum") or {})
            self._notes.append(f"resume with {', '.join(changes)}: {len(sd['residuals'])} residuals dropped, "
                               + (f"{vel} velocities dropped, " if vel else "")
                               + f"{self._force_dense} dense step(s) next")
            return
        self._load_slots(sd)

    def _load_slots(self, sd: dict) -> None:
        """The slots, the selection generator, the bucket layouts and PowerSGD's state of a checkpoint taken at
        this worker layout and mode."""
        self._force_dense = int(sd.get("force_dense", 0))
        self._slots["residual"].load(sd["residuals"], self.device)
        self._slots["momentum"].load(sd.get("momentum") or {}, self.device)
        self._slots["dense_momentum"].load(sd.get("dense_momentum") or {}, self.device)
        if sd.get("selection_rng") is not None:
            self._load_selection_rng(sd["selection_rng"], sd.get("selection_rng_device"))
        self._replay = {int(i): [(str(name), int(numel)) for name, numel in layout]
                        for i, layout in (sd.get("bucket_layouts") or {}).items()}
        self._layouts_done = dict(self._replay)
        if self._psgd is not None and sd.get("powersgd"):
            powersgd.load_state(self._psgd, sd["powersgd"], self.device)
            if not self._replay:
                # A checkpoint without bucket layouts (older): a fresh DDP's first iteration runs on its initial
                # buckets, whose indices do not match the saved per-bucket memories: run that step dense.
                self._force_dense = max(self._force_dense, 1)
        self._notes.append(f"resumed at step {self.step} with {len(self._slots['residual'])} residual and "
                           f"{len(self._slots['momentum']) + len(self._slots['dense_momentum'])} velocity tensors")

    def _load_selection_rng(self, saved: torch.Tensor, saved_device: str | None) -> None:
        """The sampled selection's generator where the checkpoint left it; a state saved on another kind of
        device (a CUDA generator's is 16 bytes, a CPU one's 5,056) cannot be loaded into this one, so the
        generator is seeded afresh from the rank and the step: selection then samples a new stream, which
        changes which near-threshold entries are sent first, not what the residuals hold."""
        saved = saved.cpu()  # set_state takes only a CPU byte tensor, also for a CUDA generator
        if saved.numel() == self._sel_gen.get_state().numel() and saved_device in (None, self.device.type):
            self._sel_gen.set_state(saved)
            return
        seed = 1234 + self.topology.rank + 100_003 * self.step
        self._sel_gen.manual_seed(seed)
        where = saved_device or f"{saved.numel()}-byte"
        self._notes.append(f"selection generator saved on a {where} device reseeded on {self.device.type} ({seed})")
        unit_log("comm_resume", f"the selection generator was saved on a {where} device: reseeded on "
                 f"{self.device.type}", seed=seed, saved_device=saved_device, saved_bytes=saved.numel())

    # --- reporting ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {"comm_mode": self.mode, "comm_auto": self.auto, "comm_path": self._builtin or "lightray hook",
                "comm_bytes": self.bytes_sent,
                "comm_bytes_inter_node": self.bytes_inter_node,
                "comm_dense_bytes": self.dense_bytes, "comm_seconds": self.comm_seconds,
                "comm_compressed_steps": self.compressed_steps, "comm_dense_steps": self.dense_steps,
                "comm_ratio_now": self.ratio_now, "comm_momentum_correction": self.momentum_correction,
                "comm_clipped_buckets": self.clipped, "comm_clip_checks": self.clip_checks,
                "comm_masked_entries": self.masked_entries, "comm_selection": self.cfg.selection,
                "comm_payload": self.cfg.payload,
                **{f"comm_selection_{k}": v for k, v in self.selection.plain().items()}}

    def _dgc_summary(self) -> str:
        """What each DGC unit and the selection did so far (a unit that changed nothing says so)."""
        c = self.cfg
        parts = [f"momentum correction {'on' if self.momentum_correction else 'off'}"
                 + (f" (nesterov={self.nesterov}, momentum now {self.momentum:g})" if self.momentum_correction else "")]
        parts.append(f"local clip {c.local_clip:g}/sqrt({self.world_size}): {self.clipped} of {self.clip_checks} "
                     "bucket-steps clipped" if c.local_clip > 0 else "local clip off")
        parts.append(f"momentum masking: {self.masked_entries} velocity entries zeroed"
                     if c.momentum_masking and self.momentum_correction else "momentum masking off")
        if c.sparsity_warmup_epochs > 0 and c.sparsity_warmup_start > c.ratio:
            parts.append(f"sparsity warm-up {c.sparsity_warmup_start:g} -> {c.ratio:g} over "
                         f"{c.sparsity_warmup_epochs:g} epoch(s): ratio {self.ratio_now:.4g} at epoch "
                         f"{self.epochs_done:.2f}")
        else:
            parts.append("sparsity warm-up off")
        sel = self.selection.plain()
        what = f"{c.payload} payload, {c.selection} selection{' per parameter' if c.per_layer else ''}"
        if c.selection == "sampled":
            what += (f": {sel['sampled']} of {sel['calls']} by sampled threshold, {sel['fallbacks']} with a count "
                     f"off [{LOW:g} k, {HIGH:g} k], {sel['padded_entries']} padded entries")
        parts.append(what)
        return ", ".join(parts)

    def describe(self) -> str:
        """One line for the log: the mode, what it did, how much it sent against dense."""
        c = self.cfg
        what = {"dense": "dense fp32 all-reduce", "fp16": "fp16-compressed all-reduce",
                "bf16": "bf16-compressed all-reduce", "powersgd": f"PowerSGD rank {c.powersgd_rank}",
                "topk": f"top-k {c.ratio:g} all-gather", "hierarchical_topk":
                f"hierarchical top-k {c.ratio:g} (dense in node, sparse across nodes)"}[self.mode]
        if self.mode in ("topk", "hierarchical_topk", "powersgd"):
            what += f", error feedback {'on' if c.error_feedback else 'off'}"
        if self.mode != "dense":
            what += f", {c.warmup_steps} dense warm-up step(s)"
        if self.mode in ("topk", "hierarchical_topk"):
            what += "; " + self._dgc_summary()
        frac = f"{self.bytes_sent / self.dense_bytes:.2%} of dense" if self.dense_bytes else "n/a"
        if self.auto:
            what = (f"auto for {c.link_gbps:g} Gbps -> " + ("undecided (dense so far)" if self._auto_pending
                                                           else what))
        if self._builtin is not None:
            what += f" by {self._builtin} (no lightray hook; bytes counted per step, not timed)"
        line = (f"comm: {what}; {self.topology.describe()}; steps {self.step} "
                f"({self.compressed_steps} compressed, {self.dense_steps} dense); sent {self.bytes_sent / 1e6:.2f} MB "
                f"({frac}), inter-node {self.bytes_inter_node / 1e6:.2f} MB")
        if self._notes:
            line += "; " + "; ".join(self._notes)
        return line


def _check_state(sd: Any) -> None:
    """Raise a ValueError naming what is wrong with a hook state that ``CommHook.state_dict`` did not write."""
    if not isinstance(sd, dict) or sd.get("version") != STATE_VERSION:
        got = sd.get("version") if isinstance(sd, dict) else type(sd).__name__
        raise ValueError(f"CommHook.load_state_dict: bad state (version {got!r}); "
                         f"expected a dict from CommHook.state_dict() with version {STATE_VERSION}")
    missing = [k for k in ("mode", "rank", "world_size", "step", "residuals") if k not in sd]
    if missing:
        raise ValueError(f"CommHook.load_state_dict: state lacks key {missing[0]!r}")


class _SubBucket:
    """The part of a DDP bucket that was one bucket of the saved layout, as torch's PowerSGD hook reads it.

    ``views`` are DDP's own gradient views of those parameters, in order: each gradient here has their shape
    and strides (DDP lays a channels_last gradient out as such in the flat buffer), at its offset in ``buffer``.
    """

    def __init__(self, index: int, buffer: torch.Tensor, views: list[torch.Tensor], last: bool):
        self._index, self._buffer, self._last = index, buffer, last
        offsets = [0, *itertools.accumulate(v.numel() for v in views)]
        self._grads = [buffer.as_strided(v.size(), v.stride(), buffer.storage_offset() + off)
                       for v, off in zip(views, offsets)]

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def is_last(self) -> bool:
        return self._last


def _replay_bucket(hook: CommHook, bucket: dist.GradBucket, layout: Layout,
                   parts: list[tuple[int, Layout]]) -> torch.futures.Future:
    """Reduce a DDP bucket as the saved buckets ``parts`` it is made of, in their order and under their
    indices, so that a resumed run selects (top-k, PowerSGD) over the same entries as it would have without
    the restart; synchronous, for one step."""
    if not hook._replay_noted:
        hook._replay_noted = True
        hook._notes.append(f"first step after the resume reduced in the saved bucket layout ({len(hook._replay)} "
                           f"bucket(s); DDP's bucket {bucket.index()} held {len(parts)})")
    buf = bucket.buffer()
    where: dict[str, tuple[int, int]] = {}
    off = 0
    for name, numel in layout:
        where[name] = (off, numel)
        off += numel
    views = {name: g for (name, _), g in zip(layout, bucket.gradients())}
    last = bucket.is_last()
    for j, (index, sub_layout) in enumerate(parts):
        sub = torch.cat([buf[where[name][0]:where[name][0] + numel] for name, numel in sub_layout])
        hook._layouts_now[index] = sub_layout
        if hook.mode == "powersgd":
            vb = _SubBucket(index, sub, [views[name] for name, _ in sub_layout], last and j == len(parts) - 1)
            out = powersgd.reduce_bucket(hook, vb).wait()
        else:
            out = hook._reduce(sub, sub_layout, index, sync=True)
        for (name, numel), piece in zip(sub_layout, out.split([numel for _, numel in sub_layout])):
            buf[where[name][0]:where[name][0] + numel].copy_(piece)
    return done(buf)


def _ddp_hook(hook: CommHook, bucket: dist.GradBucket) -> torch.futures.Future:
    """The function DDP calls per bucket; ``hook`` is the CommHook registered as state."""
    t0 = time.perf_counter()
    last = bucket.is_last()
    layout = hook._layout(bucket)
    parts = hook._replay_parts(bucket.index(), layout) if hook._replay else None
    if hook.mode == "powersgd":
        if hook._need_agree:
            hook._agree(bucket.buffer().device)
        hook._step_was_dense = hook._psgd.iter < hook._psgd.start_powerSGD_iter  # before the hook advances it
    if parts is not None:
        fut = _replay_bucket(hook, bucket, layout, parts)
    elif hook.mode == "powersgd":
        hook._layouts_now[bucket.index()] = layout
        fut = powersgd.reduce_bucket(hook, bucket)
    else:
        hook._layouts_now[bucket.index()] = layout
        fut = hook._reduce(bucket.buffer(), layout, bucket.index(), sync=False)
    hook.comm_seconds += time.perf_counter() - t0
    if hook.bucket_timings is not None:
        fut = _stamped(fut, hook.bucket_timings, bucket.index(), t0)
    if last:
        hook._end_step()
    return fut


def _stamped(fut: torch.futures.Future, log: list, index: int, t_call: float) -> torch.futures.Future:
    """Append (bucket, hook call, result ready) perf_counter times to ``log`` when ``fut`` completes."""
    def stamp(f: torch.futures.Future) -> torch.Tensor:
        log.append((index, t_call, time.perf_counter()))
        return f.value()

    return fut.then(stamp)


# DDP checks the hook's annotations against the real classes; this module's postponed (string)
# annotations would fail that check.
_ddp_hook.__annotations__ = {"hook": CommHook, "bucket": dist.GradBucket,
                             "return": torch.futures.Future[torch.Tensor]}
