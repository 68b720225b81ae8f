"""Whitened stem (``model.whiten_stem``), after airbench94 and hlb-cifar10.

The first conv of ``cifar_vgg`` sees 2 x 2 patches (12 numbers). Its 24 filters are set, once, to the
eigenvectors of the patch covariance of the first training batch, each scaled by 1/sqrt(its eigenvalue), with
both signs (12 + 12): the layer outputs decorrelated, unit-variance features and the GELU after it keeps both
halves of each direction. The weights stay frozen (only the bias trains), so the network starts from features a
linear layer would otherwise take epochs to find.

It runs at the first step of a fresh run, on rank 0's share of the first batch, and rank 0's weights are
broadcast: every rank starts from the same stem, and a resumed run keeps its checkpoint's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

EPS = 5e-4  # added to each eigenvalue: the flattest directions are noise and must not be blown up


def whitening_stem(model: nn.Module) -> nn.Conv2d:
    """The conv that can be whitened: the first conv of ``model``, with 2 x (in x kh x kw) filters."""
    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    if conv is None or conv.out_channels != 2 * conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1]:
        shape = None if conv is None else (conv.out_channels, conv.in_channels, *conv.kernel_size)
        raise ValueError(f"model.whiten_stem: the model's first conv has filters {shape}; expected one with two "
                         "filters per number of its input patch (cifar_vgg's 24 x 3 x 2 x 2)")
    return conv


def freeze_stem(model: nn.Module) -> nn.Conv2d:
    """Freeze the stem's weight at build time (before DDP and the optimiser see the parameters)."""
    conv = whitening_stem(model)
    conv.weight.requires_grad_(False)
    return conv


@torch.no_grad()
def whiten_from(conv: nn.Conv2d, x: torch.Tensor) -> dict[str, float]:
    """Set ``conv``'s filters from the patch covariance of ``x`` (N, C, H, W, normalised as the network sees it).
    Returns the largest and smallest eigenvalue, for the unit line."""
    kh, kw = conv.kernel_size
    c = conv.in_channels
    patches = x.float().unfold(2, kh, 1).unfold(3, kw, 1)  # N, C, H', W', kh, kw
    flat = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, c * kh * kw).double()
    cov = flat.T @ flat / flat.shape[0]
    eigenvalues, eigenvectors = torch.linalg.eigh(cov)  # ascending
    eigenvalues, eigenvectors = eigenvalues.flip(0), eigenvectors.T.flip(0)  # largest first, one per row
    filters = (eigenvectors / torch.sqrt(eigenvalues.clamp(min=0) + EPS)[:, None]).reshape(-1, c, kh, kw)
    conv.weight.copy_(torch.cat([filters, -filters]).to(conv.weight.dtype))
    return {"largest": float(eigenvalues[0]), "smallest": float(eigenvalues[-1]), "patches": flat.shape[0]}


def whiten_first_batch(conv: nn.Conv2d, x: torch.Tensor, world: int) -> dict[str, Any]:
    """The unit: whiten from rank 0's ``x`` and broadcast rank 0's filters to every rank. Returns the unit event
    (the caller writes it: this runs after the start's unit lines went out)."""
    info = whiten_from(conv, x)
    if world > 1:
        import torch.distributed as dist

        dist.broadcast(conv.weight.data, src=0)
    return {"unit": "whiten_stem", "enabled": True, **info,
            "message": f"stem filters set from {info['patches']:,} 2x2 patches of the first batch (eigenvalues "
                       f"{info['largest']:.3g} to {info['smallest']:.3g}), frozen; rank 0's sent to every rank"}
