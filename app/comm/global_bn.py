"""BatchNorm over the global batch, whatever the number of workers (``model.global_bn``).

Plain BatchNorm normalises each worker's share of the batch, so the same recipe takes different steps
on 1, 2 or 3 workers: the share changes with the worker count, and with an uneven split
(``lightray.data.plan.rank_slice``) it even differs between ranks. ``GlobalBatchNorm2d`` computes each
layer's statistics over the whole global batch: every rank all-reduces its per-channel sums, so the
normalisation, the gradient (the all-reduce is differentiable) and the running statistics are those of
the single-worker run, and the running statistics are bit-identical on every rank.

Why this rather than ghost BatchNorm (fixed groups of G samples): ghost BN is free of communication but
keeps the step independent of the worker count only when every rank holds whole groups and no group
straddles two ranks. ``rank_slice`` splits a global batch of 256 as 86/85/85 over 3 workers, so ghost
BN would need a group-aligned split in the data plan and ingest, a batch size that is a multiple of G
times the largest worker count, and an extra all-reduce anyway to keep the running statistics
identical on every rank. The global version needs none of that; its price is one small all-reduce per
BN layer in the forward pass and one in the backward pass (2 x 9 for resnet_tiny, a few ms per step on
gloo/CPU; latency-bound on large GPU clusters, which is why it is a switch and off by default).

On one worker (or with no process group) the layer is exactly ``nn.BatchNorm2d``.

On NCCL, torch's own ``nn.SyncBatchNorm`` does the same with fused CUDA kernels (it also weighs each rank by
its share of the batch), so :func:`to_global_bn` uses it there; this layer is for gloo, where SyncBatchNorm
does not run (its kernels are CUDA-only).

Under torch.compile the layer stays in the graph: dynamo traces the autograd.Function and turns its
``all_reduce`` into a functional collective, so a compiled model with global BN is one graph, no graph
break per layer (checked on gloo, PyTorch 2.14). The shift needs care there, see :func:`_shift_of`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks whose backward sums the gradients over ranks: every rank's loss depends on the
    summed statistics, so each rank's input gets the gradient of all ranks' losses."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 (autograd's ctx)
        out = tensor.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


@torch.library.custom_op("lightray::global_bn_shift", mutates_args=())
def _shift_snapshot(running_mean: torch.Tensor) -> torch.Tensor:
    """A copy of the running mean; an op of our own so that torch.compile saves it (see :func:`_shift_of`)."""
    return running_mean.clone()


@_shift_snapshot.register_fake
def _(running_mean: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(running_mean)


def _shift_of(running_mean: torch.Tensor) -> torch.Tensor:
    """The shift of the sums: the running mean as it was when this forward began.

    Under torch.compile a plain ``clone()`` gives wrong gradients, silently: AOTAutograd's partitioner may
    recompute ``x - shift`` in the backward from the buffer itself, which by then holds this forward's
    update of the running mean (PyTorch PR #197039, open for 2.14; the gradients of the layers below drift
    by percents). It recomputes only ops on its allowlist, which a custom op is not, so the snapshot is
    saved. Eager keeps the plain clone (a custom op's dispatch costs more per layer)."""
    if torch.compiler.is_compiling():
        return _shift_snapshot(running_mean)
    return running_mean.detach().clone()


def _group_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class GlobalBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose training statistics cover every rank's samples of the step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or _group_size() == 1:
            return super().forward(x)
        self._check_input_dim(x)
        c = self.num_features
        # Shifted sums (shift = the running mean, identical on every rank) keep E[x^2] - E[x]^2 from
        # cancelling catastrophically in fp32 once the running mean tracks the activations.
        shift = _shift_of(self.running_mean).view(1, c, 1, 1) if self.running_mean is not None else 0.0
        xs = x.to(torch.promote_types(x.dtype, torch.float32)) - shift  # fp32 statistics under autocast
        count = torch.full((1,), float(x.shape[0] * x.shape[2] * x.shape[3]), device=x.device)
        local = torch.cat([xs.sum(dim=(0, 2, 3)), (xs * xs).sum(dim=(0, 2, 3)), count])
        total = _AllReduceSum.apply(local)
        n = total[-1]
        mean_s = total[:c] / n
        var = (total[c:2 * c] / n - mean_s * mean_s).clamp_min(0.0)
        y = (xs - mean_s.view(1, c, 1, 1)) * torch.rsqrt(var.view(1, c, 1, 1) + self.eps)
        if self.affine:
            y = y * self.weight.view(1, c, 1, 1) + self.bias.view(1, c, 1, 1)
        if self.track_running_stats and self.running_mean is not None:
            self._update_running_stats(mean_s.detach() + shift.view(c), var.detach(), n.detach())
        return y.to(x.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, n: torch.Tensor) -> None:
        self.num_batches_tracked.add_(1)
        momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        unbiased = var * (n / (n - 1).clamp_min(1.0))  # nn.BatchNorm2d keeps the unbiased variance
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)


def convert_to_global_bn(model: nn.Module) -> int:
    """Replace every ``nn.BatchNorm2d`` in ``model`` by a ``GlobalBatchNorm2d`` holding the same parameters
    and buffers; returns how many were replaced."""
    replaced = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.BatchNorm2d) and not isinstance(child, GlobalBatchNorm2d):
            new = GlobalBatchNorm2d(child.num_features, eps=child.eps, momentum=child.momentum,
                                    affine=child.affine, track_running_stats=child.track_running_stats,
                                    device=child.weight.device if child.affine else None)
            new.load_state_dict(child.state_dict())
            setattr(model, name, new)
            replaced += 1
        else:
            replaced += convert_to_global_bn(child)
    return replaced


def batchnorm_kind(backend: str | None) -> str:
    """Which global BatchNorm a process group of ``backend`` (None: none) gets: torch's ``SyncBatchNorm`` on NCCL,
    ``GlobalBatchNorm2d`` elsewhere (gloo, one process)."""
    return "SyncBatchNorm" if backend == "nccl" else "GlobalBatchNorm2d"


def to_global_bn(model: nn.Module, kind: str | None = None) -> tuple[nn.Module, int, str]:
    """(model, BN layers converted, the kind used): every ``nn.BatchNorm2d`` normalises over the global batch, as
    ``batchnorm_kind`` of the current process group picks unless ``kind`` says."""
    if kind is None:
        kind = batchnorm_kind(dist.get_backend() if dist.is_available() and dist.is_initialized() else None)
    if kind == "SyncBatchNorm":
        n = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
        return nn.SyncBatchNorm.convert_sync_batchnorm(model), n, kind
    return model, convert_to_global_bn(model), kind
