"""The dense modes: ``dense`` (the fp32 ring all-reduce DDP does by default), ``fp16``/``bf16`` (the bucket divided
by the world size, cast, all-reduced, cast back, as torch's ``fp16_compress_hook`` does), and the identity of a
single worker. Under momentum correction (DGC) a dense step also keeps the global velocity (``dense_velocity``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightray.comm.dgc import accumulate_velocity
from lightray.comm.modes.base import Bucket, CommMode, Reduced, Shared
from lightray.comm.slots import Layout
from lightray.comm.wire import done, ring_allreduce_bytes


def dense_velocity(shared: Shared, buf: torch.Tensor, layout: Layout, index: int) -> Any:
    """Momentum correction on a dense step: a function from the averaged gradient to the velocity update.

    Every rank holds the same global velocity (it is built from the same mean), so the first compressed step can
    hand it to each worker's local velocity without communication (``Sparsifier.local_velocity``). The velocity is
    looked up now, on the hook's thread; the returned function runs in the collective's completion callback, where
    touching the slot store could race with the next bucket's lookup.
    """
    u = shared.slots["dense_momentum"].get(index, layout, buf.numel(), buf.device)
    shared.journal.add(u)
    v, scale, unscale = shared.velocity, shared.journal.scale, shared.journal.unscale
    momentum, nesterov = v.momentum, v.nesterov

    def post(mean: torch.Tensor) -> torch.Tensor:
        g = mean.float() if unscale is None else mean.float() * unscale  # the velocity is kept unscaled
        out = accumulate_velocity(u, g, momentum, nesterov)
        return (out if scale is None else out * scale).to(mean.dtype)

    return post


class Dense(CommMode):
    """All-reduce of the mean in the bucket's own precision."""

    name = "dense"
    dtype: torch.dtype | None = None  # None: the bucket's own

    def __init__(self, shared: Shared):
        super().__init__(shared)
        self.compresses = self.dtype is not None

    def reduce(self, bucket: Bucket, sync: bool) -> Reduced:
        buf = bucket.buffer()
        # (momentum correction on a half-precision step only under auto, which may pick fp16/bf16)
        post = dense_velocity(self.shared, buf, bucket.layout, bucket.index()) if self.shared.velocity.on else None
        return self.all_reduce_mean(buf, self.dtype or buf.dtype, sync, post)

    def all_reduce_mean(self, buf: torch.Tensor, dtype: torch.dtype, sync: bool, post: Any = None) -> Reduced:
        world = self.shared.world_size
        # Divide first (as torch's fp16 hook does) so half-precision sums cannot overflow.
        send = buf.div(world) if dtype == buf.dtype else buf.to(dtype).div_(world)
        self.shared.sent(ring_allreduce_bytes(send.numel() * send.element_size(), world))
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


class Fp16(Dense):
    """All-reduce of the mean in fp16: half the bytes."""

    name = "fp16"
    dtype = torch.float16


class Bf16(Dense):
    """All-reduce of the mean in bf16: half the bytes, fp32's range."""

    name = "bf16"
    dtype = torch.bfloat16


class Identity(CommMode):
    """A single worker: nothing to send (momentum correction still keeps its velocity)."""

    name = "identity"

    def reduce(self, bucket: Bucket, sync: bool) -> Reduced:
        buf = bucket.buffer()
        if self.shared.velocity.on:
            buf = dense_velocity(self.shared, buf, bucket.layout, bucket.index())(buf)
        return buf if sync else done(buf)
