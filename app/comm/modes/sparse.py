"""What the sparsifying modes (``topk``, ``hierarchical_topk``) share: Deep Gradient Compression's accumulation
(local clipping, momentum correction, error feedback), top-k selection, packing and the all-gather of the packed
entries.

No host syncs: selection, packing, the residual and velocity updates and local clipping run on tensors whose sizes
depend on ``n`` and ``k`` only (``lightray.comm.compress``; index_add_ and ``torch.where`` instead of boolean masks;
the clip factor a device tensor), and the counts that depend on the data (clipped buckets, masked entries,
selection misses) stay on the device until a report reads them.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.distributed as dist

from lightray.comm.compress import SelectionStats, k_for, pack, quantize, scatter_sum, select
from lightray.comm.dgc import accumulate_velocity, clip_factor, warmup_ratio
from lightray.comm.modes.base import Reduced, Shared
from lightray.comm.slots import Layout


class Sparsifier:
    """One worker's DGC state and steps, shared by the sparsifying modes (and by ``comm.mode=auto``, which may pick
    one of them after its dense steps)."""

    def __init__(self, shared: Shared):
        self.shared = shared
        c = shared.cfg
        self.epochs_done = 0.0  # epochs of samples seen, for the sparsity warm-up (set_epochs)
        self.ratio_now = warmup_ratio(c.ratio, c.sparsity_warmup_start, c.sparsity_warmup_epochs, 0.0)
        # Counts that depend on the data stay on the device (read when reported).
        self.clipped: int | torch.Tensor = 0  # bucket-steps whose local gradient was clipped
        self.clip_checks = 0
        self.masked: int | torch.Tensor = 0  # velocity entries zeroed by momentum-factor masking
        self.selection = SelectionStats()
        self.gen = torch.Generator(device=shared.device).manual_seed(1234 + shared.topology.rank)

    def set_epochs(self, epochs_done: float) -> None:
        """The sparsity warm-up's ratio after ``epochs_done`` epochs of samples seen."""
        c = self.shared.cfg
        self.epochs_done = float(epochs_done)
        self.ratio_now = warmup_ratio(c.ratio, c.sparsity_warmup_start, c.sparsity_warmup_epochs, self.epochs_done)

    def local_velocity(self, index: int, layout: Layout, n: int, device: torch.device, scale: float) -> torch.Tensor:
        """This worker's velocity for a compressed step; on the first one it starts from the dense steps' global
        velocity times ``scale`` (chosen so that the workers' contributions average to it)."""
        slots = self.shared.slots
        u = slots["momentum"].get(index, layout, n, device, create=False)
        if u is not None:
            return u
        u = slots["momentum"].get(index, layout, n, device)
        assert u is not None
        glob = slots["dense_momentum"].pop(index, layout, n, device)
        if glob is not None:
            u.copy_(glob).mul_(scale)
        return u

    def accumulate(self, g: torch.Tensor, index: int, layout: Layout, n: int, lo: int, hi: int,
                   velocity_scale: float) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """DGC's accumulation for entries [lo, hi) of a bucket: (what to sparsify, residual, velocity).

        ``g`` is the local gradient of those entries (flat topk: the worker's bucket; hierarchical: its node's sum
        over its chunk). Clipping, then velocity (momentum correction), then the residual.
        """
        c, s = self.shared.cfg, self.shared
        coef = s.journal.unscale  # 1/S under fp16 loss scaling: the state is kept unscaled
        if c.local_clip > 0:
            self.clip_checks += 1
            factor, clipped = clip_factor(g, c.local_clip, s.world_size, coef)
            self.clipped = self.clipped + clipped.long()
            coef = factor if coef is None else factor * coef
        if coef is not None:
            g = g * coef
        u = None
        acc = g
        if s.velocity.on:
            u = self.local_velocity(index, layout, n, g.device, velocity_scale)[lo:hi]
            s.journal.add(u)
            acc = accumulate_velocity(u, g, s.velocity.momentum, s.velocity.nesterov)
        residual = None
        if c.error_feedback:
            # Accumulate in place: the residual becomes the accumulator, and sparsify zeroes what it sends
            # (one pass over the bucket fewer than a separate sum and copy-back).
            residual = s.slots["residual"].get(index, layout, n, g.device)[lo:hi]
            s.journal.add(residual)
            acc = residual.add_(acc)
        return acc, residual, u

    def select(self, acc: torch.Tensor, segments: list[int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(indices to send, None or a mask of the real ones): the top ``ratio`` of the whole of ``acc``, or, with
        ``segments`` (per-parameter sizes, ``comm.per_layer``), of each parameter, as DGC selects per layer so that
        a layer of small gradients is not starved by a layer of large ones in one bucket. Padding entries (value 0,
        at their part's first index) fill up where the sampled selection found fewer; the mask is built on the
        device from the padding counts, which are never read on the host."""
        mag = acc.abs()
        parts = [(0, acc.numel())]
        if segments:
            offs = [0, *itertools.accumulate(segments)]
            parts = list(zip(offs[:-1], segments))
        idxs, pads = [], []
        for off, size in parts:
            kk = k_for(self.ratio_now, size)
            i, pad = select(mag[off:off + size] if segments else mag, kk, self.shared.cfg.selection, self.gen,
                            self.selection)
            idxs.append(i + off if off else i)
            pads.append((kk, pad))
        idx = idxs[0] if len(idxs) == 1 else torch.cat(idxs)
        if all(pad is None for _, pad in pads):
            return idx, None
        real = torch.cat([torch.arange(kk, device=acc.device) < kk - pad if pad is not None
                          else torch.ones(kk, dtype=torch.bool, device=acc.device) for kk, pad in pads])
        return idx, real

    def sparsify(self, acc: torch.Tensor, residual: torch.Tensor | None, velocity: torch.Tensor | None = None,
                 segments: list[int] | None = None) -> tuple[torch.Tensor, int]:
        """Pack the top-k of ``acc`` per ``comm.payload`` (``lightray.comm.compress.pack``); updates ``residual``
        (and, with momentum masking, ``velocity``) in place at the sent indices: with the compact payload the
        residual keeps each sent value's fp16 rounding error, so residual + sent equals ``acc`` exactly.

        Under fp16 loss scaling ``acc`` is unscaled and the values are scaled by S for the wire (fp16's range is
        what the loss scale is for). A bucket holding inf or nan goes out as nan in every value, whichever entries
        were selected, so that every rank's averaged gradient shows the overflow to its GradScaler. No host read
        anywhere: fixed-size tensors, ``torch.where`` and index_add_ instead of masks."""
        cfg, journal = self.shared.cfg, self.shared.journal
        finite = torch.isfinite(acc).all()  # before the residual (which may be acc) changes below
        idx, real = self.select(acc, segments)
        k = idx.numel()
        vals = acc[idx].float()
        wire = vals if journal.scale is None else vals * journal.scale
        if real is not None:
            wire = torch.where(real, wire, 0.0)
        sent = quantize(wire, cfg.payload)
        if residual is not None:
            if residual is not acc:
                residual.copy_(acc)
            # acc - sent at the sent indices: 0 for the fp32 payload, the rounding error for the compact one;
            # padding (value 0) adds nothing, also where its index is a real entry's.
            back = sent if journal.unscale is None else sent * journal.unscale
            residual.index_add_(0, idx, back.neg())
        if velocity is not None and cfg.momentum_masking:
            drop = velocity[idx].neg()
            velocity.index_add_(0, idx, drop if real is None else torch.where(real, drop, 0.0))
            self.masked = self.masked + (k if real is None else real.sum())
        sent = torch.where(finite, sent, math.nan)
        return pack(sent, idx, acc.numel(), cfg.payload), k

    def scatter_sum(self, parts: list[torch.Tensor], k: int, n: int, device: torch.device) -> torch.Tensor:
        """The sum of the workers' packed entries as a dense tensor of ``n``."""
        return scatter_sum(parts, k, n, self.shared.cfg.payload, device)


def gather(packed: torch.Tensor, size: int, group: Any, sync: bool, finish: Any) -> Reduced:
    """All-gather ``packed`` and return ``finish(parts)``; asynchronously (a future) unless ``sync``, so DDP's
    backward goes on computing while the collective runs, as it does for dense buckets."""
    parts = [torch.empty_like(packed) for _ in range(size)]
    if sync:
        dist.all_gather(parts, packed, group=group)
        return finish(parts)
    fut = dist.all_gather(parts, packed, group=group, async_op=True).get_future()

    def done(f: torch.futures.Future) -> torch.Tensor:
        f.wait()  # re-raises a failed collective instead of finishing on unfilled buffers
        return finish(parts)

    return fut.then(done)
