"""Top-k selection for gradient sparsification: exact ``torch.topk`` or a sampled threshold (DGC).

Exact top-k over a whole bucket costs a partial sort of millions of entries every step. Deep Gradient
Compression (Lin et al. 2018, section 3.1 and its implementation) instead estimates the magnitude
threshold from a small random sample of the bucket and selects by one comparison pass. Here the
sample's threshold aims at a few more than ``k`` candidates (``OVERSHOOT``).

Everything runs in tensors of sizes fixed by ``n`` and ``k`` alone, so selection never waits for the device
(no ``nonzero``, no count read on the host; DESIGN.md: the steady-state step never waits for the host). The
candidates are the first ``HIGH * k`` entries above the threshold and the first ``k`` equal to it, in index
order (found by binary searches in a running count); the exact top-k of them is sent:

- ``k <= count <= HIGH * k`` candidates: all of them are there, and every entry at or above the threshold
  is a candidate, so this *is* the exact top-k of the bucket (ties aside);
- ``count < k``: all candidates (the ``count`` largest entries) are sent, padded to ``k`` with (value 0,
  index 0) pairs at the end, so every rank hands the collective the same size; the padding adds nothing to
  the sum and is counted in the padded total;
- ``count > HIGH * k``: the threshold was too low. Entries strictly above it rank before those at it, so
  when there are at most ``HIGH * k`` of them (the usual cause is a tie at the threshold: zeros of dead units,
  a plateau) the result is still the exact top-k; otherwise the first ``HIGH * k`` of them by index are the
  candidates, an approximation whose rest error feedback delivers later.

A count outside ``[LOW k, HIGH k]`` is counted as a miss (``SelectionStats.fallbacks``; before selection
became sync-free such a call re-ran exact top-k). Buckets too small for sampling to pay (fewer than
``MIN_SAMPLED`` entries) always use exact top-k.
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
    """What selection did over a run (reported by the hook's ``stats``).

    ``fallbacks`` and ``padded_entries`` depend on the data: they stay device tensors (ints until the first
    sampled call), read only when reported (``plain``), so that counting them never waits for the device."""

    calls: int = 0
    sampled: int = 0  # calls that selected by a sampled threshold
    fallbacks: int | torch.Tensor = 0  # sampled calls whose count of candidates was outside [LOW k, HIGH k]
    padded_entries: int | torch.Tensor = 0  # (0, 0) pairs added to reach k (fewer than k candidates)

    def plain(self) -> dict[str, int]:
        """The counts as plain ints (reads the device: for reports, not for the step)."""
        return {"calls": self.calls, "sampled": self.sampled, "fallbacks": int(self.fallbacks),
                "padded_entries": int(self.padded_entries)}


def k_for(ratio: float, n: int) -> int:
    """Entries sent for a bucket of ``n`` entries at ``ratio`` (at least one, at most all)."""
    return min(n, max(1, math.ceil(ratio * n)))


def exact_topk(mag: torch.Tensor, k: int) -> torch.Tensor:
    return mag.topk(k, sorted=False).indices


def sampled_topk(mag: torch.Tensor, k: int, gen: torch.Generator | None = None,
                 stats: SelectionStats | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Indices of ``k`` entries of ``mag`` (non-negative magnitudes) and how many of them are padding: a 0-d
    device tensor, or None where exact top-k answered (it never pads).

    Padding entries come last, have index 0 and must be sent with value 0 (see the module docstring).
    """
    n = mag.numel()
    st = stats if stats is not None else SelectionStats()
    st.calls += 1
    if n < MIN_SAMPLED or k >= n // 4:
        return exact_topk(mag, k), None
    st.sampled += 1
    s = min(n, math.ceil(SAMPLE_HITS * n / (OVERSHOOT * k)))
    sample = mag[torch.randint(n, (s,), generator=gen, device=mag.device)]
    hits = max(1, min(s, round(OVERSHOOT * k * s / n)))
    thr = sample.topk(hits, sorted=False).values.min()
    above, at = mag > thr, mag == thr
    cap = math.ceil(HIGH * k)  # <= n / 2, as k < n / 4
    cands, found, count = [], [], 0
    # Up to cap entries above the threshold, and up to k at it (ties only ever fill up to k).
    for mask, most in ((above, cap), (at, k)):
        # The j-th candidate is where the running count first reaches j: a binary search for each rank finds the
        # first candidates in index order, with no compaction of data-dependent size.
        running = mask.view(torch.uint8).cumsum(0, dtype=torch.int32)
        ranks = torch.arange(1, most + 1, dtype=torch.int32, device=mag.device)
        cands.append(torch.searchsorted(running, ranks).clamp_(max=n - 1))
        found.append(ranks <= running[-1])
        count = count + running[-1]
    cand = torch.cat(cands)
    # Entries above the threshold are larger than those at it, so ties fill in only after them; empty slots
    # (-1) only where fewer than k candidates were found.
    top = torch.where(torch.cat(found), mag[cand], -1.0).topk(k, sorted=False)
    real = top.values >= 0
    # padding last (a stable sort of k flags: cheaper than a sorted top-k)
    order = torch.argsort((~real).view(torch.uint8), stable=True)
    real = real[order]
    idx = torch.where(real, cand[top.indices[order]], 0)
    pad = k - real.sum()
    st.fallbacks = st.fallbacks + ((count < LOW * k) | (count > HIGH * k)).long()
    st.padded_entries = st.padded_entries + pad
    return idx, pad


def select(mag: torch.Tensor, k: int, method: str, gen: torch.Generator | None = None,
           stats: SelectionStats | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``k`` indices into ``mag`` by ``method`` (``exact`` | ``sampled``) and the number of padding entries at
    their end (a 0-d device tensor; None where the method cannot pad)."""
    if method == "exact":
        if stats is not None:
            stats.calls += 1
        return exact_topk(mag, k), None
    if method == "sampled":
        return sampled_topk(mag, k, gen, stats)
    raise ValueError(f"comm.selection: bad value {method!r}; allowed: exact, sampled")


# --- the payload of the sparse all-gather ----------------------------------------------------------------
# ``fp32``: k fp32 values then k int32 indices (8 bytes an entry). ``compact``: k fp16 values, then the
# indices sorted and cut into 65,536-entry blocks of the chunk, each sent as its low 16 bits, then one int32
# count per block (4 bytes an entry plus 4 per block). The count vector has a fixed length, ceil(n / 65,536),
# so every rank hands the all-gather the same number of bytes (k is the same on all ranks). The values' fp16
# rounding error is what the hook keeps in the error-feedback residual (``quantize``), so nothing is lost.
PAYLOADS = ("compact", "fp32")
INDEX_BLOCK = 1 << 16
FP16_MAX = 65504.0


def index_blocks(n: int) -> int:
    """Blocks of ``INDEX_BLOCK`` entries a chunk of ``n`` entries is cut into (the compact count vector's length)."""
    return max(1, math.ceil(n / INDEX_BLOCK))


def payload_nbytes(k: int, n: int, payload: str) -> int:
    """Bytes one rank hands the all-gather for ``k`` entries of a chunk of ``n``."""
    if payload == "fp32":
        return 8 * k
    if payload == "compact":
        return 4 * k + 4 * index_blocks(n)
    raise ValueError(f"comm.payload: bad value {payload!r}; allowed: {', '.join(PAYLOADS)}")


def quantize(vals: torch.Tensor, payload: str) -> torch.Tensor:
    """The fp32 values the receivers will see for ``vals``: the same for ``fp32``, fp16-rounded for ``compact``
    (clamped to fp16's range first, so a huge value is sent as the largest fp16 and the rest stays behind; the
    hook sends a bucket that holds inf or nan as nan instead, see
    ``lightray.comm.modes.sparse.Sparsifier.sparsify``).
    ``vals - quantize(vals)`` is exact in fp32 (Sterbenz: the rounded value is within a factor 2 of the
    original, or zero), so residual + sent adds back to the accumulated value bit for bit."""
    if payload == "fp32":
        return vals
    return vals.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).to(torch.float32)


def pack(sent: torch.Tensor, idx: torch.Tensor, n: int, payload: str) -> torch.Tensor:
    """One flat tensor of ``sent`` (fp32, already ``quantize``d) at ``idx`` (into a chunk of ``n``) to all-gather."""
    if payload == "fp32":
        return torch.cat([sent.float(), idx.to(torch.int32).view(torch.float32)])
    if payload != "compact":
        raise ValueError(f"comm.payload: bad value {payload!r}; allowed: {', '.join(PAYLOADS)}")
    order_idx, order = idx.sort()
    # A count vector of fixed length (bincount's length depends on the largest index, which the host would
    # have to read); an index past the chunk is out of bounds here rather than a payload of another size.
    counts = torch.zeros(index_blocks(n), dtype=torch.int32, device=idx.device).scatter_add_(
        0, order_idx >> 16, torch.ones_like(order_idx, dtype=torch.int32))
    low = ((order_idx & (INDEX_BLOCK - 1)) - (INDEX_BLOCK // 2)).to(torch.int16)  # 0..65535 -> int16 range
    return torch.cat([sent[order].to(torch.float16).view(torch.uint8), low.view(torch.uint8),
                      counts.view(torch.uint8)])


def unpack(part: torch.Tensor, k: int, n: int, payload: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 values, int64 indices) of one rank's ``pack``ed payload of ``k`` entries of a chunk of ``n``."""
    if payload == "fp32":
        return part[:k], part[k:].view(torch.int32).long()
    vals = part[:2 * k].view(torch.float16).float()
    low = part[2 * k:4 * k].view(torch.int16).long() + INDEX_BLOCK // 2
    counts = part[4 * k:].view(torch.int32)
    blocks = torch.repeat_interleave(torch.arange(counts.numel(), device=part.device), counts.long(),
                                     output_size=k)
    return vals, blocks * INDEX_BLOCK + low


def scatter_sum(parts: list[torch.Tensor], k: int, n: int, payload: str, device: torch.device) -> torch.Tensor:
    """The dense sum (fp32, length ``n``) of the ranks' sparse payloads."""
    out = torch.zeros(n, dtype=torch.float32, device=device)
    for p in parts:
        vals, idx = unpack(p, k, n, payload)
        out.index_add_(0, idx, vals)
    return out
