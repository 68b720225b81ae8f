"""The crossover model: per step, which gradient communication is fastest on a given cluster, and below which
link speed a compressed mode beats dense.

One model for both users: ``comm.mode=auto`` (``CommHook`` picks its mode with it at start) and ``bench.comm``
(its projection and ``crossover_gbps``), so the bench reports exactly what auto decides on.

Alpha-beta cost of the collectives the hook runs. A step sends the whole gradient (``elements`` fp32 values,
S = 4 x elements bytes) in ``buckets`` buckets; W = N nodes x M workers per node. Traffic between nodes goes
through one link per node of ``link_gbps`` (the node's workers share it); inside a node collectives run at
``intra_gbps``. Each collective step that crosses nodes waits ``alpha_inter_s``, one inside a node
``alpha_intra_s``. With one node nothing uses the link.

- ``dense``: flat ring all-reduce (what DDP and the hook run): 2 (W-1)/W S over the link, 2 (W-1) hops a bucket.
- ``hierarchical_dense`` (a comparator; the hook does not run it, NCCL's 2-D / tree all-reduce does the like):
  reduce-scatter in the node, all-reduce of each local rank's S/M across the N nodes (all M through the node's
  link: 2 (N-1)/N S), all-gather in the node.
- ``fp16`` / ``bf16``: the flat ring on S/2, plus the casts' compute.
- ``topk``: flat ring all-gather of k (value, index) entries per rank, k = ratio x elements, of 8 bytes each
  (``payload`` fp32) or 4 bytes plus a count per 65,536-entry index block (compact): (W-1) P over the link
  for a payload of P bytes; compression compute on the whole gradient.
- ``hierarchical_topk``: dense all-reduce in the node, each local rank's top-k of its 1/M chunk all-gathered across
  the nodes ((N-1) P through the node's link in all), then an all-gather of the chunks in the node; compression
  compute on 1/M of the gradient per worker.
- ``powersgd`` (bench only): ring all-reduce of its P and Q factors, twice the messages; its compute not modelled.

Overlap: DDP hands each bucket to the hook while backward is still computing. An asynchronous collective hides
behind the backward compute that follows (``overlap_s``: backward time from the first bucket ready to the last),
a synchronous one does not. The hook's dense and half-precision all-reduces and flat top-k's all-gather are
asynchronous; hierarchical top-k's node sum and cross-node exchange are synchronous (each feeds the next), only
its closing all-gather in the node overlaps. Compression's compute runs on the hook's thread, in the critical path:

    step_s(mode) = compute_s + extra_s(mode) + sync_s(mode) + max(0, async_s(mode) - overlap_s)

``crossover_gbps(mode)``: the link speed where step_s(mode) = step_s(dense); below it the mode is faster.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lightray.comm.compress import INDEX_BLOCK, k_for, pack, quantize, select

PAIR_BYTES = 8  # a (fp32 value, int32 index) pair, as the hook packs it with comm.payload=fp32
COMPACT_ENTRY_BYTES = 4  # fp16 value + 16-bit index offset (comm.payload=compact), plus an int32 count per block
ALPHA_INTER_S = 30e-6  # a collective step between nodes (TCP on a cloud network; an assumption, not measured)
ALPHA_INTRA_S = 5e-6  # a collective step inside a node (NVLink / shared memory; an assumption)
# Collective bandwidth inside a node, by device type: NVLink-class 100 GB/s for GPUs, shared memory for CPUs.
INTRA_GBPS = {"cuda": 800.0, "cpu": 80.0}
LOW_GBPS, HIGH_GBPS = 1e-3, 1e5  # the crossover search range
AUTO_MARGIN = 0.05  # auto leaves dense only for a modelled saving of at least 5% of the step
MODES = ("dense", "hierarchical_dense", "fp16", "bf16", "topk", "hierarchical_topk", "powersgd")
FORMULA = ("step_s(mode) = compute_s + extra_s(mode) + sync_s(mode) + max(0, async_s(mode) - overlap_s); "
           "alpha-beta collectives over one link per node (link_gbps, alpha_inter_s) and intra-node links "
           "(intra_gbps, alpha_intra_s); crossover_gbps = link speed where step_s(mode) = step_s(dense)")


@dataclass(frozen=True)
class Cluster:
    """Where the workers sit and how fast they talk."""

    nodes: int
    workers_per_node: int
    link_gbps: float
    intra_gbps: float = INTRA_GBPS["cuda"]
    alpha_inter_s: float = ALPHA_INTER_S
    alpha_intra_s: float = ALPHA_INTRA_S

    @property
    def world(self) -> int:
        return self.nodes * self.workers_per_node


@dataclass(frozen=True)
class StepCosts:
    """What one worker's step is made of (seconds are per step, for the whole gradient)."""

    elements: int
    buckets: int
    ratio: float
    compress_s: float  # top-k compression compute over the whole gradient: selection, packing, error feedback
    cast_s: float = 0.0  # fp32 -> half precision and back over the whole gradient
    overlap_s: float = 0.0  # backward compute from the first bucket ready to the last (hides async collectives)
    compute_s: float = 0.0  # forward + backward (the same for every mode: reported, never decisive)
    powersgd_elements: int = 0  # elements PowerSGD all-reduces (P and Q, plus the tensors it leaves dense)
    payload: str = "fp32"  # the sparse modes' all-gather payload (comm.payload): fp32 or compact


def sparse_payload_bytes(s: StepCosts, chunks_per_bucket: int = 1) -> float:
    """Bytes of the (value, index) entries one node's ranks hand a sparse all-gather per step, in all: k entries
    of 8 bytes (fp32 payload), or of 4 bytes plus a 4-byte count per 65,536-entry index block of every chunk
    (compact payload; a bucket is cut into ``chunks_per_bucket`` chunks, one per local rank, under
    hierarchical top-k)."""
    k = s.ratio * s.elements
    if s.payload == "fp32":
        return PAIR_BYTES * k
    chunk = s.elements / max(1, s.buckets * chunks_per_bucket)
    blocks = s.buckets * chunks_per_bucket * max(1, math.ceil(chunk / INDEX_BLOCK))
    return COMPACT_ENTRY_BYTES * k + 4.0 * blocks


def _ring(nbytes: float, ranks: int, gbps: float, alpha: float, msgs: int) -> float:
    """Ring all-reduce of ``nbytes`` among ``ranks``: reduce-scatter + all-gather."""
    return 0.0 if ranks <= 1 else 2 * (ranks - 1) / ranks * nbytes * 8 / (gbps * 1e9) + msgs * 2 * (ranks - 1) * alpha


def _half_ring(nbytes: float, ranks: int, gbps: float, alpha: float, msgs: int) -> float:
    """Reduce-scatter or all-gather of ``nbytes`` in total among ``ranks``."""
    return 0.0 if ranks <= 1 else (ranks - 1) / ranks * nbytes * 8 / (gbps * 1e9) + msgs * (ranks - 1) * alpha


def parts(mode: str, c: Cluster, s: StepCosts) -> dict[str, float]:
    """The mode's cost per step: bytes through each node's link, synchronous and asynchronous collective
    seconds, and the compute it adds (see the module docstring)."""
    n, m, w, b = c.nodes, c.workers_per_node, c.world, s.buckets
    size = 4.0 * s.elements
    # flat collectives run at the speed of their slowest hop: the link as soon as there are two nodes
    gbps, alpha = (c.link_gbps, c.alpha_inter_s) if n > 1 else (c.intra_gbps, c.alpha_intra_s)
    crossing = n > 1
    if mode == "dense" or (mode == "hierarchical_topk" and n == 1):  # one node: the hook reduces densely
        return {"inter_bytes": 2 * (w - 1) / w * size * crossing, "sync_s": 0.0,
                "async_s": _ring(size, w, gbps, alpha, b), "extra_s": 0.0}
    if mode == "hierarchical_dense":
        t = (2 * _half_ring(size, m, c.intra_gbps, c.alpha_intra_s, b)
             + _ring(size, n, c.link_gbps, c.alpha_inter_s, b))  # M chunks of S/M share the link: 2(N-1)/N S
        return {"inter_bytes": 2 * (n - 1) / n * size, "sync_s": 0.0, "async_s": t, "extra_s": 0.0}
    if mode in ("fp16", "bf16"):
        return {"inter_bytes": (w - 1) / w * size * crossing, "sync_s": 0.0,
                "async_s": _ring(size / 2, w, gbps, alpha, b), "extra_s": s.cast_s}
    if mode == "topk":
        payload = sparse_payload_bytes(s)
        t = 0.0 if w <= 1 else (w - 1) * payload * 8 / (gbps * 1e9) + b * (w - 1) * alpha
        return {"inter_bytes": (w - 1) * payload * crossing, "sync_s": 0.0, "async_s": t, "extra_s": s.compress_s}
    if mode == "hierarchical_topk":
        cross = (n - 1) * sparse_payload_bytes(s, m)  # the M local ranks' gathers of their chunks, through one link
        sync = (_ring(size, m, c.intra_gbps, c.alpha_intra_s, b)
                + cross * 8 / (c.link_gbps * 1e9) + b * (n - 1) * c.alpha_inter_s)
        return {"inter_bytes": cross, "sync_s": sync,
                "async_s": _half_ring(size, m, c.intra_gbps, c.alpha_intra_s, b), "extra_s": s.compress_s / m}
    if mode == "powersgd":
        psgd = 4.0 * s.powersgd_elements
        return {"inter_bytes": 2 * (w - 1) / w * psgd * crossing, "sync_s": 0.0,
                "async_s": _ring(psgd, w, gbps, alpha, 2 * b), "extra_s": 0.0}
    raise ValueError(f"mode: bad value {mode!r}; allowed: {', '.join(MODES)}")


def step_s(mode: str, c: Cluster, s: StepCosts) -> float:
    p = parts(mode, c, s)
    return s.compute_s + p["extra_s"] + p["sync_s"] + max(0.0, p["async_s"] - s.overlap_s)


def _at(c: Cluster, gbps: float) -> Cluster:
    return Cluster(c.nodes, c.workers_per_node, gbps, c.intra_gbps, c.alpha_inter_s, c.alpha_intra_s)


def crossover_gbps(mode: str, c: Cluster, s: StepCosts) -> float | None:
    """The link speed (Gbit/s) below which ``mode`` has a shorter modelled step than dense. None when it is
    never faster within [LOW_GBPS, HIGH_GBPS]; HIGH_GBPS when it is faster at every speed in that range."""
    def gain(gbps: float) -> float:
        return step_s("dense", _at(c, gbps), s) - step_s(mode, _at(c, gbps), s)

    if mode == "dense" or gain(LOW_GBPS) <= 0:
        return None
    if gain(HIGH_GBPS) > 0:
        return HIGH_GBPS
    lo, hi = math.log(LOW_GBPS), math.log(HIGH_GBPS)
    for _ in range(60):  # the gain falls as the link gets faster (dense sends the most bytes)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gain(math.exp(mid)) > 0 else (lo, mid)
    return float(f"{math.exp(lo):.4g}")


def table(c: Cluster, s: StepCosts, modes: tuple[str, ...] | list[str]) -> dict[str, dict[str, Any]]:
    """Per mode: modelled step and its parts at the cluster's link speed, and the crossover link speed."""
    out = {}
    for mode in modes:
        p = parts(mode, c, s)
        out[mode] = {"step_s": round(step_s(mode, c, s), 6), "inter_node_bytes": int(p["inter_bytes"]),
                     "sync_comm_s": round(p["sync_s"], 6), "async_comm_s": round(p["async_s"], 6),
                     "extra_compute_s": round(p["extra_s"], 6),
                     "crossover_gbps": None if mode == "dense" else crossover_gbps(mode, c, s)}
    return out


def choose(c: Cluster, s: StepCosts, candidates: list[str]) -> tuple[str, str, dict[str, Any]]:
    """(mode, why, evidence): the candidate with the shortest modelled step, dense unless another saves at least
    ``AUTO_MARGIN`` of dense's step (compression also costs some accuracy, which the model does not see)."""
    rows = table(c, s, ["dense", *[m for m in candidates if m != "dense"]])
    dense = rows["dense"]["step_s"]
    best = min(rows, key=lambda m: rows[m]["step_s"])
    if best != "dense" and rows[best]["step_s"] > (1 - AUTO_MARGIN) * dense:
        best = "dense"
    steps = ", ".join(f"{m} {1e3 * r['step_s']:.3f} ms" for m, r in rows.items())
    cross = ", ".join(f"{m} {r['crossover_gbps']}" for m, r in rows.items() if m != "dense")
    why = (f"picked {best} for a {c.link_gbps:g} Gbps link between {c.nodes} node(s) x {c.workers_per_node} "
           f"worker(s): modelled step {steps}; faster than dense below (Gbps): {cross or 'no candidate'}; "
           f"inputs: {s.elements} elements in {s.buckets} bucket(s), ratio {s.ratio:g}, {s.payload} payload, "
           f"compression {1e3 * s.compress_s:.2f} ms, casts {1e3 * s.cast_s:.2f} ms, backward overlap window "
           f"{1e3 * s.overlap_s:.2f} ms, intra-node {c.intra_gbps:g} Gbps")
    return best, why, {"cluster": asdict(c), "costs": asdict(s), "modes": rows, "model": FORMULA}


# --- measuring the inputs on this worker's device ---------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_compression(elements: int, ratio: float, selection: str, device: torch.device,
                     max_elements: int = 1 << 22, reps: int = 2, payload: str = "compact") -> float:
    """Seconds of top-k compression over ``elements`` on ``device``: error-feedback add, selection, packing and
    the residual update, on up to ``max_elements`` random values, scaled linearly (every pass is linear)."""
    n = max(1, min(elements, max_elements))
    gen = torch.Generator(device=device).manual_seed(0)
    g = torch.randn(n, generator=gen, device=device)
    residual = torch.zeros(n, device=device)
    k = k_for(ratio, n)
    best = math.inf
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        acc = residual.add_(g)
        idx, _ = select(acc.abs(), k, selection, gen)
        vals = acc[idx]
        sent = quantize(vals, payload)
        packed = pack(sent, idx, n, payload)
        acc[idx] = vals - sent
        _sync(device)
        best = min(best, time.perf_counter() - t0)
        del packed
    return best * elements / n


def time_cast(elements: int, dtype: torch.dtype, device: torch.device, max_elements: int = 1 << 22,
              reps: int = 2) -> float:
    """Seconds to divide and cast ``elements`` fp32 values to ``dtype`` and back (the half-precision modes)."""
    n = max(1, min(elements, max_elements))
    x = torch.randn(n, device=device, generator=torch.Generator(device=device).manual_seed(0))
    best = math.inf
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        y = x.to(dtype).div_(2).to(torch.float32)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
        del y
    return best * elements / n


def half_mode(device: torch.device) -> str:
    """The half-precision mode auto considers: bf16 where the device computes it, else fp16."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "fp16"
    return "bf16"
