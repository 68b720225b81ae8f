"""Per-sample draws hashed from (seed, stream, epoch, sample id), vectorised over a batch: for the draws made
inside the training step or for whole blocks at once, where the crop's per-sample numpy generators
(``augment.sample_uniforms``, about 50 ms for a 1,024-image batch) would cost too much. Whichever process,
node or worker count serves a sample, and whether the run was resumed, it gets the same draws."""

from __future__ import annotations

import numpy as np


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 whose outputs pass as independent uniforms."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hashed_uniforms(seed: int, stream: int, epochs: np.ndarray, ids: np.ndarray, k: int) -> np.ndarray:
    """(n, k) uniforms in [0, 1): draw j of sample i a function of (seed, stream, epochs[i], ids[i], j) only.
    ``stream`` keeps one use's draws apart from another's of the same (seed, epoch, id)."""
    with np.errstate(over="ignore"):
        key = _mix64(np.uint64(seed & (2**64 - 1)) ^ np.uint64(stream))
        key = _mix64(key ^ epochs.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
        key = _mix64(key ^ ids.astype(np.uint64))
        z = _mix64(key[:, None] + np.arange(1, k + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    return (z >> np.uint64(11)).astype(np.float64) / float(2**53)
