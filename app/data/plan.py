"""The deterministic epoch plan: which samples each global step trains on, and which rank gets which.

The order of epoch ``e`` is a function of ``(seed, e)`` alone: a permutation of the shards, then a
permutation of the rows inside each shard (shard granularity keeps reads sequential, the inner shuffle
mixes classes). Global step ``s`` of the epoch takes plan positions ``[s*B, (s+1)*B)``; the tail that
does not fill a global batch is left out of that epoch (a different tail each epoch). Rank ``r`` of
``W`` takes a contiguous slice of each global batch, so the global set of samples per step does not
depend on the number of workers, and a resume at step ``s`` picks up exactly where training stopped.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


class EpochPlan:
    """Orders ``sum(shard_rows)`` samples, addressed as (shard index, row in shard)."""

    def __init__(self, shard_rows: list[int], seed: int):
        self.shard_rows = np.asarray(shard_rows, dtype=np.int64)
        self.seed = int(seed)
        self.offsets = np.concatenate([[0], np.cumsum(self.shard_rows)])
        self.num_samples = int(self.offsets[-1])

    def order(self, epoch: int) -> np.ndarray:
        """Global row indices (into the concatenated shards) in training order for ``epoch``."""
        return _order(tuple(self.shard_rows.tolist()), self.seed, int(epoch))

    def step_rows(self, epoch: int, step: int, global_batch: int) -> np.ndarray:
        return self.order(epoch)[step * global_batch:(step + 1) * global_batch]

    def to_shard_row(self, global_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shard = np.searchsorted(self.offsets, global_rows, side="right") - 1
        return shard, global_rows - self.offsets[shard]


@lru_cache(maxsize=4)
def _order(shard_rows: tuple, seed: int, epoch: int) -> np.ndarray:
    rng = np.random.default_rng([seed, epoch, 0x5EED])
    offsets = np.concatenate([[0], np.cumsum(shard_rows)])
    parts = []
    for s in rng.permutation(len(shard_rows)):
        parts.append(offsets[s] + rng.permutation(shard_rows[s]))
    out = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    out.setflags(write=False)
    return out


def rank_slice(global_batch: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's part of a global batch; the first ``B % W`` ranks take one more."""
    base, extra = divmod(global_batch, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)
