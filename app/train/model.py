"""Models: torchvision ResNets for ImageNet and a small ResNet for the CPU demo.

Two speed-up units live here: ``zero_init_residual`` (Goyal et al. 2017, used by fast.ai's DAWNBench
run: the last BN gamma of every residual block starts at 0, so each block starts as the identity and
large-batch training is stable early) and ``channels_last`` (NHWC memory, which lets cuDNN use the
tensor-core convolution kernels without transposes).
"""

from __future__ import annotations

import torch
import torchvision
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck

from app.config import ModelConfig
from app.train.device import unit_log
from app.train.global_bn import convert_to_global_bn

ARCHS = ("resnet_tiny", "resnet18", "resnet34", "resnet50")


class TinyResNet(nn.Module):
    """A ResNet for 32-64 px inputs: 3x3 stem (stride 2, no max-pool), one BasicBlock per stage at
    widths 32/64/128, global average pool, linear head. About 0.3M parameters.

    The stride-2 stem keeps a 64 px input affordable on two CPU cores (the first stage runs at 32x32)
    while a 32 px input still ends at a 4x4 map.
    """

    def __init__(self, num_classes: int, widths: tuple[int, ...] = (32, 64, 128), blocks_per_stage: int = 1):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        )
        stages: list[nn.Module] = []
        in_ch = widths[0]
        for i, w in enumerate(widths):
            layers: list[nn.Module] = []
            for j in range(blocks_per_stage):
                stride = 2 if (i > 0 and j == 0) else 1
                down = None
                if stride != 1 or in_ch != w:
                    down = nn.Sequential(nn.Conv2d(in_ch, w, 1, stride=stride, bias=False), nn.BatchNorm2d(w))
                layers.append(BasicBlock(in_ch, w, stride=stride, downsample=down))
                in_ch = w
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def residual_last_bns(model: nn.Module) -> list[nn.BatchNorm2d]:
    """The BN closing the residual branch of every block (bn2 of a BasicBlock, bn3 of a Bottleneck)."""
    out: list[nn.BatchNorm2d] = []
    for m in model.modules():
        if isinstance(m, Bottleneck):
            out.append(m.bn3)
        elif isinstance(m, BasicBlock):
            out.append(m.bn2)
    return out


def build_model(cfg: ModelConfig, num_classes: int) -> nn.Module:
    """The network named by ``cfg.arch`` with ``num_classes`` outputs, randomly initialised (no weights)."""
    if num_classes < 1:
        raise ValueError(f"num_classes: bad value {num_classes}; expected at least 1")
    if cfg.arch == "resnet_tiny":
        model: nn.Module = TinyResNet(num_classes)
    elif cfg.arch in ("resnet18", "resnet34", "resnet50"):
        # zero_init_residual is applied below for every arch, the same way, so pass False here.
        model = getattr(torchvision.models, cfg.arch)(weights=None, num_classes=num_classes)
    else:
        raise ValueError(f"model.arch: bad value {cfg.arch!r}; allowed: {', '.join(ARCHS)}")
    if cfg.global_bn:  # before the zero-init below, which must reach the swapped layers
        n_bn = convert_to_global_bn(model)
        unit_log("global_bn", f"{n_bn} BN layers normalise over the global batch (one all-reduce each per "
                 "forward and backward when there is more than one worker)", layers=n_bn)
    else:
        unit_log("global_bn", "off (model.global_bn=false): each worker normalises its own share of the batch",
                 layers=0)
    bns = residual_last_bns(model)
    if cfg.zero_init_residual:
        for bn in bns:
            nn.init.zeros_(bn.weight)
        unit_log("zero_init_residual", f"zeroed the last BN gamma of {len(bns)} residual blocks", blocks=len(bns))
    else:
        unit_log("zero_init_residual", "off (model.zero_init_residual=false): BN gammas start at 1", blocks=0)
    n_params = sum(p.numel() for p in model.parameters())
    unit_log("model", f"{cfg.arch}: {n_params / 1e6:.2f}M parameters, {num_classes} classes", params=n_params)
    return model


def to_device(model: nn.Module, device: torch.device, cfg: ModelConfig) -> nn.Module:
    """Move ``model`` to ``device``, in channels_last memory when ``cfg.channels_last`` is on.

    Inputs must then be channels_last too (``app.train.device.images_to_device`` does that) or every
    conv pays a layout conversion.
    """
    model = model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
        unit_log("channels_last", f"model weights in channels_last (NHWC) on {device.type}", enabled=True)
    else:
        unit_log("channels_last", "off (model.channels_last=false): contiguous NCHW", enabled=False)
    return model


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module under DDP (``.module``) and/or torch.compile (``._orig_mod``) wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model
