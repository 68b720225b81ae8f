"""Adaptive gradient fusion: pick the DDP bucket size from measured all-reduce timings.

DDP fuses gradients into buckets (25 MB by default) and all-reduces each bucket as soon as its
gradients are ready, overlapping communication with the rest of the backward pass. Small buckets
pay the per-message latency ``alpha`` many times; big buckets leave a long un-overlapped transfer
at the end of the backward pass (the last bucket cannot start before the backward pass ends). With
the alpha-beta model ``t(s) = alpha + beta * s`` of one all-reduce of ``s`` bytes and ``S`` bytes of
gradients in buckets of ``b`` bytes, the exposed cost is about

    T(b) = (S / b) * alpha  +  b * beta        (latency of every bucket + transfer of the last one)

which is smallest at ``b* = sqrt(S * alpha / beta)``. ``choose_bucket_mb`` measures ``alpha`` and
``beta`` on the real process group (a few all-reduces of 64 KiB .. ``max_mb``; every rank adopts the
slowest rank's timings, so all ranks choose the same size), fits them by least squares and returns
``b*`` clamped to ``[min_mb, gradient size]``, with the measurements as evidence for the log. On a
25 Gbps cluster of 128 workers alpha is large (2(W-1) network latencies per ring all-reduce) and the
choice grows; on one machine it shrinks. ``comm.bucket_mb > 0`` pins the size (``pinned_mb``); a resume at
an unchanged world size keeps the size its checkpoint ran with (``saved_mb``), since the bucket layout decides
which entries top-k selects from together, and a size measured afresh would change the run after a restart.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

TORCH_DEFAULT_MB = 25.0
MB = 1024 * 1024


def gradient_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def fit_alpha_beta(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """Least-squares ``t = alpha + beta * s``; alpha and beta are kept positive (noise can flip them)."""
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError(f"fit_alpha_beta: need >= 2 (size, time) pairs of equal count, got {len(sizes)} sizes "
                         f"and {len(times)} times")
    ms, mt = statistics.fmean(sizes), statistics.fmean(times)
    var = sum((s - ms) ** 2 for s in sizes)
    if var == 0:
        raise ValueError("fit_alpha_beta: all sizes are equal; need at least two different message sizes")
    beta = sum((s - ms) * (t - mt) for s, t in zip(sizes, times)) / var
    beta = max(beta, 1e-15)
    alpha = max(mt - beta * ms, 1e-7)
    return alpha, beta


def exposed_cost(bucket_bytes: float, grad_bytes: float, alpha: float, beta: float) -> float:
    """Modelled exposed communication seconds for buckets of ``bucket_bytes`` (see module docstring)."""
    b = min(max(bucket_bytes, 1.0), max(grad_bytes, 1.0))
    return math.ceil(grad_bytes / b) * alpha + b * beta


def optimal_bucket_mb(grad_bytes: float, alpha: float, beta: float, min_mb: float = 1.0,
                      max_mb: float = 256.0) -> float:
    """``sqrt(S alpha / beta)`` in MB, clamped to [min_mb, min(max_mb, gradient size)], 2 significant digits."""
    best = math.sqrt(grad_bytes * alpha / beta) / MB
    hi = max(min_mb, min(max_mb, grad_bytes / MB))
    best = min(max(best, min_mb), hi)
    digits = 1 - int(math.floor(math.log10(best)))
    return round(best, digits)


def _time_allreduce(nbytes: int, device: torch.device, group: Any, repeats: int) -> float:
    t = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dist.all_reduce(t, group=group)  # warm-up: connection set-up and allocator
    sync()
    samples = []
    for _ in range(repeats):
        dist.barrier(group=group)  # start together, or the first rank's time includes the others' lag
        t0 = time.perf_counter()
        dist.all_reduce(t, group=group)
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def choose_bucket_mb(model: torch.nn.Module, world_size: int, device: torch.device,
                     process_group: Any = None, *, pinned_mb: float = 0.0, saved_mb: float = 0.0,
                     max_mb: float = 32.0,  # largest probe
                     min_mb: float = 1.0, points: int = 5, repeats: int = 3) -> tuple[float, dict]:
    """(bucket size in MB, evidence). A collective unless pinned or saved: every rank of ``process_group`` must
    call it with the same ``pinned_mb`` and ``saved_mb``."""
    grad = gradient_bytes(model)
    evidence: dict[str, Any] = {"grad_mb": round(grad / MB, 3), "world_size": world_size}
    if pinned_mb > 0:
        return float(pinned_mb), dict(evidence, pinned=True, reason="comm.bucket_mb pins the bucket size")
    if saved_mb > 0:
        return float(saved_mb), dict(evidence, pinned=False, saved=True,
                                     reason="kept from the checkpoint (same world size): not measured again")
    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return TORCH_DEFAULT_MB, dict(evidence, pinned=False,
                                      reason="single worker: nothing to communicate, torch's 25 MB kept")
    device = torch.device(device)
    top = max(min(max_mb * MB, grad), 256 * 1024)
    low = 64 * 1024
    sizes = sorted({int(low * (top / low) ** (i / max(1, points - 1))) for i in range(points)})
    t0 = time.perf_counter()
    local = [_time_allreduce(s, device, process_group, repeats) for s in sizes]
    times = torch.tensor(local, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=process_group)
    agreed = times.cpu().tolist()
    alpha, beta = fit_alpha_beta([float(s) for s in sizes], agreed)
    # sqrt(S alpha / beta) is the optimum of the continuous model; with whole buckets (ceil) and the clamps a
    # neighbour can do better, so the final pick is the cheapest of it, equal splits of the gradient, and 25 MB.
    # (25 MB counts only below the gradient size; above it, it is the same one bucket as k = 1.)
    candidates = {optimal_bucket_mb(grad, alpha, beta, min_mb=min_mb)}
    candidates |= {max(min_mb, grad / k / MB) for k in range(1, 33)}  # exact: k whole buckets, never above S
    candidates |= {TORCH_DEFAULT_MB} if TORCH_DEFAULT_MB * MB <= grad else set()
    chosen = min(sorted(candidates), key=lambda mb: exposed_cost(mb * MB, grad, alpha, beta))
    evidence.update(
        pinned=False, sizes_bytes=sizes, allreduce_s=[round(x, 6) for x in agreed], alpha_s=alpha,
        beta_s_per_byte=beta, bandwidth_gbps=round(8 / beta / 1e9, 3),
        modelled_exposed_s={"chosen": exposed_cost(chosen * MB, grad, alpha, beta),
                            "torch_default_25mb": exposed_cost(TORCH_DEFAULT_MB * MB, grad, alpha, beta)},
        rule="cheapest modelled of b* = sqrt(grad_bytes * alpha / beta) (clamped to [min_mb, grad size]), "
             "grad/k for k = 1..32, and 25 MB",
        measure_s=round(time.perf_counter() - t0, 3))
    return chosen, evidence
