"""Top-k selection for gradient sparsification: exact ``torch.topk`` or a sampled threshold (DGC).

Exact top-k over a whole bucket costs a partial sort of millions of entries every step. Deep Gradient
Compression (Lin et al. 2018, section 3.1 and its implementation) instead estimates the magnitude
threshold from a small random sample of the bucket and selects by one comparison pass. Here the
sample's threshold aims at a few more than ``k`` candidates (``OVERSHOOT``), so that:

- when ``k <= count <= HIGH * k``: the exact top-k of the candidates is taken. Every entry at or above
  the threshold is a candidate, so this *is* the exact top-k of the bucket (ties aside), for the cost
  of a comparison pass plus a top-k over ``count`` entries;
- when ``LOW * k <= count < k``: all candidates (the ``count`` largest entries) are sent, padded to
  ``k`` with (value 0, index 0) pairs, so every rank hands the collective the same size; the padding
  adds nothing to the sum and is counted in the padded total;
- otherwise (the sample misjudged a skewed distribution) exact ``torch.topk`` runs: a fallback, counted.

Buckets too small for sampling to pay (fewer than ``MIN_SAMPLED`` entries) always use exact top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SAMPLE_HITS = 256  # expected candidates inside the sample: sets the threshold's relative error (~1/16)
OVERSHOOT = 1.3  # aim at 1.3 k candidates so that the count rarely falls below k
LOW, HIGH = 0.5, 2.0  # outside [LOW k, HIGH k] candidates the sampled threshold is rejected
MIN_SAMPLED = 32_768


@dataclass
class SelectionStats:
    """What selection did over a run (reported by the hook's ``stats``)."""

    calls: int = 0
    sampled: int = 0  # calls answered by the sampled threshold
    fallbacks: int = 0  # calls where the sampled count was out of bounds and exact top-k ran
    padded_entries: int = 0  # (0, 0) pairs added to reach k (count between LOW k and k)


def k_for(ratio: float, n: int) -> int:
    """Entries sent for a bucket of ``n`` entries at ``ratio`` (at least one, at most all)."""
    return min(n, max(1, math.ceil(ratio * n)))


def exact_topk(mag: torch.Tensor, k: int) -> torch.Tensor:
    return mag.topk(k, sorted=False).indices


def sampled_topk(mag: torch.Tensor, k: int, gen: torch.Generator | None = None,
                 stats: SelectionStats | None = None) -> tuple[torch.Tensor, int]:
    """Indices of ``k`` entries of ``mag`` (non-negative magnitudes) and how many of them are padding.

    Padding entries have index 0 and must be sent with value 0 (see the module docstring).
    """
    n = mag.numel()
    st = stats if stats is not None else SelectionStats()
    st.calls += 1
    if n < MIN_SAMPLED or k >= n // 4:
        return exact_topk(mag, k), 0
    s = min(n, math.ceil(SAMPLE_HITS * n / (OVERSHOOT * k)))
    sample = mag[torch.randint(n, (s,), generator=gen, device=mag.device)]
    hits = max(1, min(s, round(OVERSHOOT * k * s / n)))
    thr = sample.topk(hits, sorted=False).values.min()
    cand = (mag >= thr).nonzero().squeeze(1)
    count = cand.numel()
    if count < LOW * k or count > HIGH * k:
        st.fallbacks += 1
        return exact_topk(mag, k), 0
    st.sampled += 1
    if count >= k:
        return cand[mag[cand].topk(k, sorted=False).indices], 0
    pad = k - count
    st.padded_entries += pad
    return torch.cat([cand, torch.zeros(pad, dtype=cand.dtype, device=cand.device)]), pad


def select(mag: torch.Tensor, k: int, method: str, gen: torch.Generator | None = None,
           stats: SelectionStats | None = None) -> tuple[torch.Tensor, int]:
    """``k`` indices into ``mag`` by ``method`` (``exact`` | ``sampled``) and the number of padding entries."""
    if method == "exact":
        if stats is not None:
            stats.calls += 1
        return exact_topk(mag, k), 0
    if method == "sampled":
        return sampled_topk(mag, k, gen, stats)
    raise ValueError(f"comm.selection: bad value {method!r}; allowed: exact, sampled")
