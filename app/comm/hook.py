"""Gradient communication for DDP: one ``CommHook`` per worker picks the mode that reduces each bucket and keeps what
all the modes share.

``install`` registers the hook on the DDP model; DDP hands it each gradient bucket (the flat concatenation of some
parameters' local gradients) and takes back the averaged bucket. Each mode (``comm.mode``) is a module of
``lightray.comm.modes`` behind one interface (``modes.base.CommMode.reduce(bucket, sync)``), as torch's own DDP comm
hooks are laid out:

- ``dense`` (``modes.dense``): ring all-reduce of the fp32 bucket (what DDP does by default);
  ``fp16`` / ``bf16``: the bucket is divided by the world size, cast, all-reduced, cast back.
- ``topk`` (``modes.topk``) and ``hierarchical_topk`` (``modes.hierarchical``): top-k with error feedback, flat or
  dense inside a node and sparse across nodes; their DGC steps are shared (``modes.sparse``).
- ``powersgd`` (``modes.powersgd``): torch's PowerSGD hook (rank ``comm.powersgd_rank``), for comparison.
- ``auto``: the hook runs its first ``AUTO_MEASURE_STEPS`` steps dense and measures, on this worker, the backward
  window the buckets arrive in (on the last of them: DDP rebuilds its buckets after the first step), the
  compression's and the half-precision casts' compute over the gradient's size; the ranks agree on the largest of
  each (one all-reduce), and at the first bucket of the next step the crossover model (``lightray.comm.auto``)
  picks dense, bf16 (fp16 where the GPU lacks bf16) or hierarchical top-k for ``comm.link_gbps`` and the
  node/worker layout, logged as the ``comm_auto`` unit with its inputs and modelled step times. The choice is saved
  in the checkpoint and kept on resume while the worker set's layout is the same (a new worker adopts it from the
  others); a new layout decides again. Momentum correction, when asked for, is the hook's from the first step
  whichever mode is picked, so the optimizer's momentum never switches owner mid-run.

What the modes share (``modes.base.Shared``): the slot store of residuals and velocities (``lightray.comm.slots``,
per parameter name, robust to DDP's bucket rebuild), the fp16 loss-scale journal (``lightray.comm.loss_scale``),
the byte meter (``lightray.comm.wire``) and momentum correction's state. What the hook does for every mode: the
agreement of the ranks at the first bucket after install or load, the dense warm-up (``comm.warmup_steps``) and
the dense steps after a worker-set change, the step and byte counts, ``auto``'s measurement, the replay of the
saved bucket layout on the first step after a resume (``lightray.comm.replay``), the checkpoint and the reports.

Where no lightray unit needs the bucket (``comm.builtin``, on by default; :meth:`CommHook.builtin_path`), ``dense``
is DDP's own all-reduce and ``fp16``/``bf16`` without a dense warm-up are torch's ``fp16_compress_hook`` /
``bf16_compress_hook``: the same arithmetic without a Python call per bucket. The hook object then only counts the
steps and the bytes they send (``begin_step``) and keeps its checkpoint state.

Deep Gradient Compression's accuracy units (``lightray.comm.dgc``; each off by default, each reported at set-up
through ``unit_log`` and in ``describe``/``stats``): momentum correction (``comm.momentum_correction``: velocity,
not gradient, goes into the residual; the hook then owns momentum and the SGD optimizer runs with momentum 0, see
``optimizer_momentum``), local gradient clipping (``comm.local_clip``), momentum-factor masking
(``comm.momentum_masking``) and a sparsity warm-up (``comm.sparsity_warmup_epochs``, driven by ``begin_step(epochs
of samples seen)``). Selection (``comm.selection``): exact ``torch.topk`` or a sampled threshold
(``lightray.comm.compress``).

Overlap: through DDP every compressed bucket returns the future of its collective (flat top-k: the all-gather;
hierarchical: the closing all-gather inside the node), so backward goes on computing the next buckets while it
runs, as for dense. All hook state is read and written on the hook's thread before the collective starts;
completion callbacks only combine the received tensors.

No host syncs in the steady state (DESIGN.md; ``modes.sparse`` says how). ``tests/test_comm_host_sync.py`` runs
the compression on data-free "meta" tensors. What still waits for the device: the first bucket after
install/load (``_agree``), ``comm.mode=auto``'s one decision, the replayed first step after a resume, and torch's
own PowerSGD hook.

With a single worker nothing is communicated and every mode is the identity.

Checkpoints: the state is per worker (each worker's residual is its own undelivered gradient), so every rank saves
its own ``state_dict()`` (e.g. ``comm_rank{rank}.pt``) and loads its own. The state is tensors and plain values
(PowerSGD's NumPy generator as its key array and counters), so it loads with ``weights_only=True``; it may be
loaded to any device, and ``load_state_dict`` moves each tensor to the hook's device (the selection generator's
state to the CPU, where ``set_state`` wants it). The state also holds DDP's bucket layouts of the last step, which
the first step after a resume replays; with the bucket size kept too (``lightray.comm.fusion``), a resume at an
unchanged layout continues the run uninterrupted exactly, in every mode. Worker-count-change policy
(``load_state_dict(sd, world_size)``): when the world size, the node layout, the rank or the mode differ from the
saved ones, the residuals are dropped (they are undelivered gradient of workers that may not exist any more,
scaled for another world size) and the next ``comm.resize_dense_steps`` steps run dense, so the optimizer gets
full gradients while the new residuals build up; the step count is kept so the warm-up is not repeated.

Byte meter: ``bytes_sent`` counts the bytes this worker puts on the wire per the standard algorithms (ring
all-reduce: ``2 (W-1)/W * size``; all-gather: ``(W-1) * own payload``). ``bytes_inter_node`` counts the part that
crosses nodes (for flat modes over several nodes, all of it: a ring's node-crossing links carry the same volume as
the others). ``dense_bytes`` is what dense fp32 would have sent for the same buckets, so ``bytes_sent /
dense_bytes`` is the achieved compression.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightray.comm import auto as comm_auto
from lightray.comm.compress import HIGH, LOW
from lightray.comm.modes import powersgd
from lightray.comm.modes.base import Bucket, CommMode, Reduced, Shared, Velocity
from lightray.comm.modes.dense import Bf16, Dense, Fp16, Identity
from lightray.comm.modes.hierarchical import HierarchicalTopK, NodeGroups, NoGroups, make_groups
from lightray.comm.modes.sparse import Sparsifier
from lightray.comm.modes.topk import TopK
from lightray.comm.replay import replay, replay_parts
from lightray.comm.slots import Layout
from lightray.comm.topology import Topology
from lightray.comm.wire import done, ring_allreduce_bytes
from lightray.config import CommConfig
from lightray.units import unit_log

STATE_VERSION = 1
AUTO_CHOICES = ("dense", "fp16", "bf16", "hierarchical_topk")  # what comm.mode=auto can pick (codes 1..4)
AUTO_MEASURE_STEPS = 2  # dense steps comm.mode=auto measures before it decides
SPARSE = ("topk", "hierarchical_topk")


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
        # DGC units (lightray.comm.dgc). Momentum correction replaces the optimizer's momentum, which only works for
        # plain SGD (LARS/LAMB scale the update per layer after their own momentum).
        sparse = cfg.mode in (*SPARSE, "auto")
        self.shared = Shared(cfg, topology, self.device,
                             velocity=Velocity(cfg.momentum_correction and sparse and optimizer == "sgd", nesterov))
        self.sparse = Sparsifier(self.shared)
        self._modes: dict[str, CommMode] = {m.name: m for m in (Dense(self.shared), Fp16(self.shared),
                                                                Bf16(self.shared), TopK(self.shared, self.sparse),
                                                                Identity(self.shared))}
        self.groups: NodeGroups | None = None  # hierarchical top-k's process groups, made at prepare
        self._init_meters()
        self._force_dense = 0
        self._step_was_dense = False
        self._builtin: str | None = None  # set by install: the mode runs on DDP's own path (builtin_path)
        self._builtin_bytes = (0, 0)  # (sent, dense) bytes of one step's all-reduce on that path
        self._names_by_ptr: dict[int, str] = {}
        self._notes: list[str] = []
        self._prepared = False
        self._effective = self.mode
        self._need_agree = True  # agree on step / forced dense steps at the first bucket (see _agree)
        self._new_step = True
        self._psgd: Any = None
        # DDP's bucket layouts: those of the step running (index -> layout), of the last finished step (saved
        # in the checkpoint), and, after a resume, the saved ones the first step replays (lightray.comm.replay).
        self._layouts_now: dict[int, Layout] = {}
        self._layouts_done: dict[int, Layout] = {}
        self._replay: dict[int, Layout] = {}
        self._replay_noted = False
        self.bucket_timings: list[tuple[int, float, float]] | None = None  # (bucket, hook call, future done)
        self._init_auto()
        self.auto_evidence: dict[str, Any] | None = None
        if self.auto and self.world_size == 1:
            unit_log("comm_auto", "picked dense: a single worker communicates nothing", chosen="dense")
        self._unit_events(optimizer, sparse)
        if self.mode == "powersgd":
            self._modes["powersgd"] = psgd = powersgd.PowerSGD(self.shared)
            self._psgd = psgd.state

    def _init_meters(self) -> None:
        """The step count and the time meters that ``stats`` reports (the bytes are ``shared.meter``'s)."""
        self.step = 0  # optimizer steps seen by the hook (a step ends with DDP's last bucket)
        self.comm_seconds = 0.0  # wall time inside the hook's synchronous parts
        self.compressed_steps = 0
        self.dense_steps = 0

    def _init_auto(self) -> None:
        """``comm.mode=auto``'s measurement of the first dense steps."""
        # comm.mode=auto: pending until decided; what the measured step saw (bucket calls, elements, buckets)
        self._auto_pending = self.auto and self.world_size > 1
        # Marks (_clock_mark) of the first and last bucket of the step being measured, and of the last one measured.
        self._auto_first: Any = None
        self._auto_last: Any = None
        self._auto_elements = self._auto_buckets = self._auto_steps = 0
        self._auto_window: tuple[Any, Any] | None = None

    # The meters and DGC counts, where callers and checkpoints have always read them.
    bytes_sent = property(lambda self: self.shared.meter.sent,
                          lambda self, v: setattr(self.shared.meter, "sent", v))
    bytes_inter_node = property(lambda self: self.shared.meter.inter_node,
                                lambda self, v: setattr(self.shared.meter, "inter_node", v))
    dense_bytes = property(lambda self: self.shared.meter.dense,
                           lambda self, v: setattr(self.shared.meter, "dense", v))
    momentum_correction = property(lambda self: self.shared.velocity.on)
    nesterov = property(lambda self: self.shared.velocity.nesterov)
    momentum = property(lambda self: self.shared.velocity.momentum)
    selection = property(lambda self: self.sparse.selection)
    ratio_now = property(lambda self: self.sparse.ratio_now)
    epochs_done = property(lambda self: self.sparse.epochs_done)
    clip_checks = property(lambda self: self.sparse.clip_checks)
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
        overflow on one rank is sent as nan (``Sparsifier.sparsify``), so every rank's scaler sees it; but the other
        ranks, and the other buckets, updated their residuals for a step that then never happened. Which step was
        skipped is known only after ``scaler.update()``: it lowered the scale (its backoff factor is < 1, and it
        backs off exactly when it skipped). So each slot tensor a step changes is copied first, and at the next
        step's first bucket ``torch.where(scale now < scale then, copy, value)`` puts back the copies of a
        skipped step, on the device.
        """
        self.shared.journal.follow(scaler)

    @property
    def clipped(self) -> int:
        """Bucket-steps whose local gradient was clipped (reads the device: for reports)."""
        return int(self.sparse.clipped)

    @property
    def masked_entries(self) -> int:
        """Velocity entries zeroed by momentum-factor masking (reads the device: for reports)."""
        return int(self.sparse.masked)

    def optimizer_momentum(self, momentum: float) -> float:
        """Record the schedule's momentum for this step; return the momentum the optimizer should use.

        With momentum correction the hook applies momentum itself, on every step (dense warm-up steps
        keep a global velocity, compressed steps each worker's local one), and returns the averaged
        velocity: the optimizer must then run plain SGD (momentum 0), or momentum would be applied twice.
        Returning 0 on every step, not only on compressed ones, keeps the optimizer's own momentum
        buffer empty, so no stale buffer resurfaces when steps switch between dense and compressed.
        Weight decay stays in the optimizer and so acts on the weights without momentum.
        """
        self.shared.velocity.momentum = float(momentum)
        return 0.0 if self.momentum_correction else float(momentum)

    def begin_step(self, epochs_done: float) -> None:
        """Tell the hook how many epochs of samples have been seen (drives the sparsity warm-up). On a built-in
        path (no hook call per bucket) this counts the step and the bytes its all-reduce sends."""
        if self._builtin is not None:
            self.step += 1
            self.dense_steps += 1
            self.shared.sent(self._builtin_bytes[0])
            self.shared.meter.dense += self._builtin_bytes[1]
        self.sparse.set_epochs(epochs_done)

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
        groups = make_groups(self.topology, self.group_timeout)
        if isinstance(groups, NoGroups):
            self._no_groups(groups)
            return
        self.groups = groups
        self._modes["hierarchical_topk"] = HierarchicalTopK(self.shared, self.sparse, groups)

    def _no_groups(self, why: NoGroups) -> None:
        """Hierarchical top-k cannot run here: auto leaves it out; asked for, it falls back and says so."""
        if why.why == "uneven":
            if self.auto:
                self._notes.append("auto: nodes hold different worker counts: hierarchical top-k is no candidate")
                return
            self._effective = "topk"
            self._notes.append(f"nodes hold different worker counts {why.sizes}: "
                               "hierarchical top-k falls back to flat top-k")
            return
        if self.auto:
            self._notes.append("auto: one node: hierarchical top-k would reduce densely, no candidate")
            return
        self._effective = "dense"
        self._notes.append("one node: nothing crosses the network, buckets are reduced densely")

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
        if mode == "hierarchical_topk" and self.groups is None:
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
        candidates = [half, *(["hierarchical_topk"] if self.groups is not None else [])]
        mode, why, evidence = comm_auto.choose(cluster, costs, candidates)
        self._apply_auto(mode)
        self.auto_evidence = evidence
        self._notes.append(f"auto: {why}")
        unit_log("comm_auto", why, chosen=mode, link_gbps=c.link_gbps, candidates=candidates,
                 modes={m: r["step_s"] for m, r in evidence["modes"].items()})

    def _dense_now(self) -> bool:
        return self.mode == "dense" or self.step < self.cfg.warmup_steps or self._force_dense > 0

    def _mode_now(self) -> CommMode:
        """The mode that reduces this step's buckets: the identity for one worker, dense in a warm-up or after a
        worker-set change, else the run's (a mode with its own warm-up, PowerSGD, only yields to the latter)."""
        run = self._modes.get(self.mode)
        if run is not None and run.own_warmup:
            return self._modes["dense"] if self._force_dense > 0 else run
        if self._effective == "identity":
            return self._modes["identity"]
        if self._dense_now() or self._effective == "dense":
            return self._modes["dense"]
        return self._modes[self._effective]

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
            run = self._modes.get(self.mode)
            if self._force_dense > 0 and run is not None:
                run.passed_over()
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
        out = self._reduce(Bucket(bucket_index, buffer, layout, last=last), sync=True)
        assert isinstance(out, torch.Tensor)
        self.comm_seconds += time.perf_counter() - t0
        if last:
            self._end_step()
        return out

    def _reduce(self, bucket: Bucket, sync: bool) -> Reduced:
        """What every mode's bucket goes through: the step's start, the agreement, auto's measurement, the dense
        meter; then the mode of this step reduces it."""
        buf = bucket.buffer()
        if self._new_step:
            self._new_step = False
            self.shared.journal.begin_step()
        if self._need_agree:
            self._agree(buf.device)
        if self._auto_pending:
            self._auto_tick(buf.numel(), buf.device)
        self.shared.meter.dense += ring_allreduce_bytes(buf.numel() * 4, self.world_size)
        mode = self._mode_now()
        self._step_was_dense = not mode.compressed_now()
        return mode.reduce(bucket, sync)

    # --- per-parameter state (residuals, velocities) ----------------------------------------------
    def residuals(self) -> dict[str, torch.Tensor]:
        """Per-parameter residuals (flat, fp32, on CPU, unscaled under fp16 loss scaling), keyed by parameter
        name; as the loss scaler's decision on the last step leaves them (``LossScaleJournal.as_decided``)."""
        with self.shared.journal.as_decided():
            return self.shared.slots["residual"].per_param()

    def velocities(self) -> dict[str, torch.Tensor]:
        """Per-parameter local velocities of momentum correction (flat, fp32, on CPU, unscaled like residuals)."""
        with self.shared.journal.as_decided():
            return self.shared.slots["momentum"].per_param()

    # --- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This worker's state: residuals per parameter name, step count, byte counters, topology."""
        with self.shared.journal.as_decided():
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
            "dense_momentum": self.shared.slots["dense_momentum"].per_param(),
            "selection_rng": self.sparse.gen.get_state().cpu(),
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
        for store in self.shared.slots.values():
            store.clear()
        self.shared.journal.clear()  # its tensors belonged to the state just replaced
        self._new_step = True
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
        scaled = sd.get("residual_units") != "unscaled" and (sd["residuals"] or vel_saved)
        if self.shared.journal.scaler is not None and scaled:
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
        self.shared.slots["residual"].load(sd["residuals"], self.device)
        self.shared.slots["momentum"].load(sd.get("momentum") or {}, self.device)
        self.shared.slots["dense_momentum"].load(sd.get("dense_momentum") or {}, self.device)
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
        slots = self.shared.slots
        self._notes.append(f"resumed at step {self.step} with {len(slots['residual'])} residual and "
                           f"{len(slots['momentum']) + len(slots['dense_momentum'])} velocity tensors")

    def _load_selection_rng(self, saved: torch.Tensor, saved_device: str | None) -> None:
        """The sampled selection's generator where the checkpoint left it; a state saved on another kind of
        device (a CUDA generator's is 16 bytes, a CPU one's 5,056) cannot be loaded into this one, so the
        generator is seeded afresh from the rank and the step: selection then samples a new stream, which
        changes which near-threshold entries are sent first, not what the residuals hold."""
        saved = saved.cpu()  # set_state takes only a CPU byte tensor, also for a CUDA generator
        if saved.numel() == self.sparse.gen.get_state().numel() and saved_device in (None, self.device.type):
            self.sparse.gen.set_state(saved)
            return
        seed = 1234 + self.topology.rank + 100_003 * self.step
        self.sparse.gen.manual_seed(seed)
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


def _replayed(hook: CommHook, bucket: Bucket, parts: list[tuple[int, Layout]]) -> torch.futures.Future:
    """The first step after a resume: ``bucket`` reduced as the saved buckets it is made of (lightray.comm.replay),
    synchronously, for one step."""
    if not hook._replay_noted:
        hook._replay_noted = True
        hook._notes.append(f"first step after the resume reduced in the saved bucket layout ({len(hook._replay)} "
                           f"bucket(s); DDP's bucket {bucket.index()} held {len(parts)})")

    def reduce(sub: Bucket) -> Reduced:
        hook._layouts_now[sub.index()] = sub.layout
        return hook._reduce(sub, sync=True)

    return done(replay(bucket, parts, reduce))


def _ddp_hook(hook: CommHook, bucket: dist.GradBucket) -> torch.futures.Future:
    """The function DDP calls per bucket; ``hook`` is the CommHook registered as state."""
    t0 = time.perf_counter()
    last = bucket.is_last()
    layout = hook._layout(bucket)
    view = Bucket(bucket.index(), bucket.buffer(), layout, bucket.gradients, last)
    parts = replay_parts(hook._replay, bucket.index(), layout) if hook._replay else None
    if parts is not None:
        fut = _replayed(hook, view, parts)
    else:
        hook._layouts_now[bucket.index()] = layout
        out = hook._reduce(view, sync=False)
        fut = done(out) if isinstance(out, torch.Tensor) else out  # a mode may finish synchronously
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
