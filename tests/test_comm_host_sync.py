"""The communication hook's steady-state compute never waits for the device (DESIGN.md).

On CUDA a host read inside the hook (``.item()``, ``float()``, ``nonzero``, ``bincount``, boolean-mask indexing)
stalls backward until the GPU catches up. ``torch.cuda.set_sync_debug_mode`` does not exist on the CPU, so the
check here runs the hook's own compute (accumulation with clipping, velocity and residual, selection, packing, the
residual and velocity updates, unpacking the gathered parts; under fp16 loss scaling too) on tensors of torch's
"meta" device: they have shapes but no data, so every operation whose result or output size depends on the values
raises, and every fixed-size one runs. The second call of each is the steady state (state exists, and under loss
scaling the first step's journal is settled).
"""

from __future__ import annotations

import pytest
import torch

from lightray.comm.compress import MIN_SAMPLED, payload_nbytes
from lightray.comm.hook import CommHook
from lightray.comm.modes.dense import dense_velocity
from lightray.comm.topology import Topology
from lightray.config import CommConfig

META = torch.device("meta")
LAYOUT = [("w", MIN_SAMPLED + 7_000), ("b", MIN_SAMPLED // 2)]  # the first passes MIN_SAMPLED, so sampling runs
N = sum(n for _, n in LAYOUT)
CASES = {
    "exact_fp32": {"payload": "fp32"},
    "compact_payload": {},  # was: bincount for the per-block counts
    "sampled_selection": {"selection": "sampled"},  # was: nonzero for the candidates
    "sampled_per_layer": {"selection": "sampled", "per_layer": True, "payload": "fp32"},  # was: mask indexing
    "local_clip": {"local_clip": 1.0, "payload": "fp32"},  # was: float(norm)
    "dgc": {"momentum_correction": True, "momentum_masking": True, "local_clip": 1.0, "selection": "sampled",
            "per_layer": True},
}


def _hook(**kw) -> CommHook:
    # the hook lives on the CPU (its selection generator does; randint takes it for meta tensors too)
    cfg = CommConfig(**{"mode": "topk", "ratio": 0.01, "warmup_steps": 0, "payload": "compact", **kw})
    hook = CommHook(cfg, Topology.simulated(2, 0, 2), torch.device("cpu"), optimizer="sgd")
    hook.optimizer_momentum(0.9)
    return hook


def _compress(hook: CommHook, lo: int = 0, hi: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    """One bucket through the hook's compute as the top-k modes run it, minus the collectives."""
    g = torch.empty(hi - lo, device=META)
    segments = [n for _, n in LAYOUT] if hook.cfg.per_layer and (lo, hi) == (0, N) else None
    acc, residual, u = hook.sparse.accumulate(g, 0, LAYOUT, N, lo, hi, 1.0)
    packed, k = hook.sparse.sparsify(acc, residual, u, segments)
    gathered = hook.sparse.scatter_sum([torch.empty_like(packed), torch.empty_like(packed)], k, hi - lo, META)
    return packed, gathered


@pytest.mark.parametrize("case", list(CASES))
def test_steady_state_compression_runs_on_data_free_tensors(case):
    hook = _hook(**CASES[case])
    for _ in range(2):
        packed, gathered = _compress(hook)
    assert gathered.device == META and gathered.shape == (N,)
    k = sum(-(-n // 100) for _, n in LAYOUT) if hook.cfg.per_layer else -(-N // 100)
    assert packed.numel() * packed.element_size() == payload_nbytes(k, N, hook.cfg.payload)
    if hook.cfg.selection == "sampled":
        assert hook.selection.sampled >= 2  # the sampled path ran (not exact top-k on a small bucket)
    if hook.cfg.local_clip > 0:
        assert hook.clip_checks == 2


def test_hierarchical_chunk_and_dense_velocity_run_on_data_free_tensors():
    hook = _hook(mode="hierarchical_topk", momentum_correction=True, momentum_masking=True, local_clip=1.0,
                 selection="sampled")
    for _ in range(2):
        _, gathered = _compress(hook, lo=N // 2, hi=N)  # a node's second member sparsifies the second chunk
    assert gathered.shape == (N - N // 2,)
    # a dense (warm-up) step under momentum correction: the velocity update on the averaged gradient
    post = dense_velocity(hook.shared, torch.empty(N, device=META), LAYOUT, 1)
    assert post(torch.empty(N, device=META)).shape == (N,)


def test_fp16_loss_scaling_path_runs_on_data_free_tensors():
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones((), device=META))  # the scaler makes its scale tensor where the loss lives
    hook = _hook(momentum_correction=True, momentum_masking=True, local_clip=1.0, selection="sampled")
    hook.follow_loss_scale(scaler)
    for _ in range(2):
        hook.shared.journal.begin_step()  # a step's first bucket: settle the last step's journal, read the scale
        _compress(hook)
        post = dense_velocity(hook.shared, torch.empty(N, device=META), LAYOUT, 1)
        post(torch.empty(N, device=META))
        hook._end_step()
    assert hook.shared.journal.scale is not None and hook.shared.journal.scale.device == META
    assert len(hook.shared.journal.entries) == 3  # the residual, the velocity and the dense velocity of the last step
