"""The first step after a resume, reduced in the saved bucket layout.

A fresh DDP runs its first iteration on its initial buckets (one bucket of every parameter, in torch 2.x) and
rebuilds them in gradient-ready order only after it, so the first step after a resume would select over other
entries than the same step of the run uninterrupted. Reducing that step's buckets as the saved buckets they are made
of keeps the selection, the residual keys and PowerSGD's per-bucket memories as they were.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from lightray.comm.modes.base import Bucket, Reduced
from lightray.comm.slots import Layout


def replay_parts(saved: dict[int, Layout], index: int, layout: Layout) -> list[tuple[int, Layout]] | None:
    """The saved buckets (index, layout) that bucket ``index`` of this step is made of, when it is not itself a
    saved one; None when it is, or when the saved buckets do not tile it."""
    if saved.get(index) == layout:
        return None
    mine = dict(layout)
    parts = [(i, sub) for i, sub in sorted(saved.items())
             if sub and all(mine.get(name) == numel for name, numel in sub)]
    covered = [name for _, sub in parts for name, _ in sub]
    if len(covered) != len(mine) or set(covered) != set(mine):
        return None
    return parts


def _views(buffer: torch.Tensor, views: list[torch.Tensor]) -> list[torch.Tensor]:
    """``views``' shapes and strides laid over ``buffer`` in order, as torch's PowerSGD hook reads a bucket's
    gradients (DDP lays a channels_last gradient out as such in the flat buffer)."""
    offsets = [0, *itertools.accumulate(v.numel() for v in views)]
    return [buffer.as_strided(v.size(), v.stride(), buffer.storage_offset() + off) for v, off in zip(views, offsets)]


def replay(bucket: Bucket, parts: list[tuple[int, Layout]], reduce: Callable[[Bucket], Reduced]) -> torch.Tensor:
    """Reduce ``bucket`` as the saved buckets ``parts``, in their order and under their indices, each synchronously
    through ``reduce``; the result is written back into the bucket's buffer."""
    buf, layout = bucket.buffer(), bucket.layout
    where: dict[str, tuple[int, int]] = {}
    off = 0
    for name, numel in layout:
        where[name] = (off, numel)
        off += numel
    grads = dict(zip((name for name, _ in layout), bucket.gradients()))
    for j, (index, sub_layout) in enumerate(parts):
        sub = torch.cat([buf[where[name][0]:where[name][0] + numel] for name, numel in sub_layout])
        views = _views(sub, [grads[name] for name, _ in sub_layout]) if grads else []
        out = reduce(Bucket(index, sub, sub_layout, views, bucket.is_last() and j == len(parts) - 1))
        assert isinstance(out, torch.Tensor)
        for (name, numel), piece in zip(sub_layout, out.split([numel for _, numel in sub_layout])):
            buf[where[name][0]:where[name][0] + numel].copy_(piece)
    return buf
