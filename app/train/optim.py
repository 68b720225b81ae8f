"""Optimisers (SGD + Nesterov, LARS, LAMB), their parameter groups, the loss, gradient clipping.

* Parameter groups: no weight decay on BatchNorm parameters and biases unless ``optim.bn_bias_decay``
  (Goyal et al. 2017; fast.ai DAWNBench; Jia et al. 2018). The same split decides which tensors LARS and
  LAMB adapt layer-wise: excluded from decay means excluded from adaptation (as in the reference LAMB
  code for BERT, and in Jia et al.'s LARS); with ``bn_bias_decay`` every tensor is adapted, as in the
  original LARS paper.
* LARS is ``timm.optim.Lars`` and LAMB ``timm.optim.Lamb`` (global-norm clipping off, since the
  published LAMB has none): ``tests/test_optim.py`` checks one step of each against the published
  update formulas (You et al. 2017, Algorithm 1; You et al. 2019, Algorithm 2). timm applies the
  learning rate outside the momentum buffer (as torch's SGD does) where the LARS paper puts it inside;
  the two agree whenever the LR is constant between steps and differ only by how a changing LR
  reaches past momentum.
* The learning rate and momentum come from ``lightray.schedule.Schedule`` and are written into the optimiser
  before every step by :func:`set_lr_momentum`; what the optimiser was built with does not matter.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from lightray.config import OptimConfig
from lightray.units import unit_log

# Parameters of these modules never get weight decay (they set scale and shift, not features).
_NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm, nn.modules.instancenorm._InstanceNorm)


def split_decay(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(weights that take decay, norm-layer parameters and biases), each parameter once, in model order."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(module, _NORM_TYPES) or name == "bias" or p.ndim <= 1:
                no_decay.append(p)
            else:
                decay.append(p)
    return decay, no_decay


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict[str, Any]]:
    """Two groups: ``decay`` (conv/linear weights) and ``no_decay`` (BN parameters and biases); with
    ``cfg.bn_lr_factor`` != 1 a third, ``bn``: the BN parameters, at that multiple of the LR (``lr_factor``).

    ``no_decay`` gets ``weight_decay=0`` unless ``cfg.bn_bias_decay``. ``always_adapt`` tells timm's
    LARS/LAMB which group gets the layer-wise trust ratio even at zero decay; torch's SGD ignores it.
    """
    decay, no_decay = split_decay(model)
    bn_wd = cfg.weight_decay if cfg.bn_bias_decay else 0.0
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay, "name": "decay", "always_adapt": True},
        {"params": no_decay, "weight_decay": bn_wd, "name": "no_decay", "always_adapt": cfg.bn_bias_decay},
    ]
    if cfg.bn_lr_factor != 1.0:
        # A third group only when the factor is on, so the checkpoints of runs without it keep their two groups.
        norm = {id(p) for m in model.modules() if isinstance(m, _NORM_TYPES) for p in m.parameters(recurse=False)}
        groups[1]["params"] = [p for p in no_decay if id(p) not in norm]
        groups.append({"params": [p for p in no_decay if id(p) in norm], "name": "bn", "lr_factor": cfg.bn_lr_factor,
                       "weight_decay": bn_wd / cfg.bn_lr_factor if cfg.bn_lr_factor > 0 else 0.0,
                       "always_adapt": cfg.bn_bias_decay})
    return [g for g in groups if g["params"]]


def _foreach_kw(cls: type, fused: bool) -> dict[str, Any]:
    """``{"foreach": fused}`` when this timm's optimiser takes it (timm < 1.0.30 has no such argument and
    picks its single-tensor loop)."""
    return {"foreach": fused} if "foreach" in inspect.signature(cls.__init__).parameters else {}


def _fused_supported(device: torch.device) -> bool:
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        return device.type in _get_fused_kernels_supported_devices()
    except ImportError:  # private helper moved: be conservative
        return device.type == "cuda"


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """The optimiser named by ``cfg.name`` over :func:`param_groups` of ``model``.

    With ``cfg.fused`` SGD uses torch's fused kernel where torch has one for the device (one launch for
    all tensors), LARS/LAMB timm's foreach (multi-tensor) path; off gives the per-tensor loop.
    """
    groups = param_groups(model, cfg)
    n_decay = sum(p.numel() for g in groups if g["name"] == "decay" for p in g["params"])
    n_rest = sum(p.numel() for g in groups if g["name"] != "decay" for p in g["params"])
    lr = cfg.lr_per_256  # placeholder: set_lr_momentum writes the schedule's value before each step
    nesterov = cfg.nesterov and cfg.momentum > 0
    if cfg.name == "sgd":
        for g in groups:
            g.pop("always_adapt")
        fused = cfg.fused and _fused_supported(device)
        opt: torch.optim.Optimizer = torch.optim.SGD(
            groups, lr=lr, momentum=cfg.momentum, nesterov=nesterov, weight_decay=cfg.weight_decay,
            fused=True if fused else None, foreach=None if fused else cfg.fused,
        )
        kernel = "fused" if fused else ("foreach" if cfg.fused else "per-tensor loop")
        what = f"SGD(momentum={cfg.momentum}, nesterov={nesterov}), {kernel} kernel"
    elif cfg.name == "lars":
        from timm.optim import Lars

        opt = Lars(groups, lr=lr, momentum=cfg.momentum, nesterov=nesterov, trust_coeff=cfg.trust_coefficient,
                   eps=cfg.lars_eps, weight_decay=cfg.weight_decay, **_foreach_kw(Lars, cfg.fused))
        what = (f"LARS(trust_coefficient={cfg.trust_coefficient}, momentum={cfg.momentum}, nesterov={nesterov}), "
                f"{'foreach' if _foreach_kw(Lars, cfg.fused).get('foreach') else 'per-tensor loop'}")
    elif cfg.name == "lamb":
        from timm.optim import Lamb

        opt = Lamb(groups, lr=lr, betas=(cfg.momentum, cfg.lamb_beta2), eps=cfg.lamb_eps,
                   weight_decay=cfg.weight_decay, max_grad_norm=None, **_foreach_kw(Lamb, cfg.fused))
        what = (f"LAMB(beta1={cfg.momentum}, beta2={cfg.lamb_beta2}, eps={cfg.lamb_eps}), "
                f"{'foreach' if _foreach_kw(Lamb, cfg.fused).get('foreach') else 'per-tensor loop'}")
    else:
        raise ValueError(f"optim.name: bad value {cfg.name!r}; allowed: sgd, lars, lamb")
    unit_log("optimizer", what, name=cfg.name)
    if cfg.grad_clip > 0:
        unit_log("grad_clip", f"global gradient norm clipped to {cfg.grad_clip}", max_norm=cfg.grad_clip)
    else:
        unit_log("grad_clip", "off (optim.grad_clip=0)", max_norm=0.0)
    if cfg.bn_bias_decay:
        unit_log("bn_bias_decay", f"off: weight decay {cfg.weight_decay} on all {n_decay + n_rest} parameters "
                 "(optim.bn_bias_decay=true)", excluded=0)
    else:
        unit_log("bn_bias_decay", f"no weight decay on {n_rest} BN/bias parameters; {cfg.weight_decay} on "
                 f"{n_decay} weights", excluded=n_rest)
    n_bn = sum(p.numel() for g in groups if g["name"] == "bn" for p in g["params"])
    unit_log("bn_lr_factor", f"{n_bn} BatchNorm parameters train at {cfg.bn_lr_factor}x the LR, their decay divided "
             "by it" if n_bn else "off (optim.bn_lr_factor=1): BatchNorm parameters train at the LR",
             factor=cfg.bn_lr_factor if n_bn else 1.0, params=n_bn)
    return opt


def set_lr_momentum(opt: torch.optim.Optimizer, lr: float, momentum: float) -> None:
    """Write the schedule's LR and momentum into every group (LAMB's momentum is its beta1)."""
    for g in opt.param_groups:
        g["lr"] = lr * g.get("lr_factor", 1.0)
        if "betas" in g:
            g["betas"] = (momentum, g["betas"][1])
        elif "momentum" in g:
            g["momentum"] = momentum


def build_loss(cfg: OptimConfig) -> nn.Module:
    """Cross-entropy with ``cfg.label_smoothing``: (1 - e) * CE(target) + e * mean over classes of -log p."""
    if cfg.label_smoothing > 0:
        unit_log("label_smoothing", f"cross-entropy with label smoothing {cfg.label_smoothing}",
                 value=cfg.label_smoothing)
    else:
        unit_log("label_smoothing", "off (optim.label_smoothing=0): plain cross-entropy", value=0.0)
    return nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)


def clip_gradients(
    model: nn.Module, opt: torch.optim.Optimizer, cfg: OptimConfig, scaler: torch.amp.GradScaler | None = None
) -> torch.Tensor | None:
    """Clip the global gradient norm to ``cfg.grad_clip`` (after unscaling fp16 grads); None when off.

    Call after backward (and after DDP's all-reduce, i.e. after ``loss.backward()`` returns) and before
    ``scaler.step(opt)``. Returns the norm before clipping as a 0-d tensor on the gradients' device: reading it
    as a float would wait for the GPU on every step (a host sync), so only a caller that reports it reads it.
    """
    if cfg.grad_clip <= 0:
        return None
    if scaler is not None and scaler.is_enabled():
        scaler.unscale_(opt)
    return torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], cfg.grad_clip)
