"""The ``topk`` mode: each worker adds its residual to its local gradient, keeps the ``k = ceil(ratio * n)``
largest-magnitude entries, and all-gathers (value, index) pairs; the average of the sparse contributions is the
result. With error feedback the entries not sent stay in the residual and are added again next step (Stich et al.
2018; Tencent's record used it between nodes)."""

from __future__ import annotations

import torch

from lightray.comm.modes.base import Bucket, CommMode, Reduced, Shared
from lightray.comm.modes.sparse import Sparsifier, gather
from lightray.comm.wire import allgather_bytes


class TopK(CommMode):
    name = "topk"
    compresses = True

    def __init__(self, shared: Shared, sparsifier: Sparsifier):
        super().__init__(shared)
        self.sparse = sparsifier

    def reduce(self, bucket: Bucket, sync: bool) -> Reduced:
        buf, layout, index = bucket.buffer(), bucket.layout, bucket.index()
        world, n = self.shared.world_size, buf.numel()
        acc, residual, u = self.sparse.accumulate(buf.float(), index, layout, n, 0, n, 1.0)
        segments = [numel for _, numel in layout] if self.shared.cfg.per_layer and len(layout) > 1 else None
        packed, k = self.sparse.sparsify(acc, residual, u, segments)
        self.shared.sent(allgather_bytes(packed.numel() * packed.element_size(), world))

        def finish(parts: list[torch.Tensor]) -> torch.Tensor:
            return self.sparse.scatter_sum(parts, k, n, buf.device).div_(world).to(buf.dtype)

        return gather(packed, world, None, sync, finish)
