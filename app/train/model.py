"""Models: any torchvision classification model, any timm model (``timm:<name>``), and a small ResNet
for the CPU demo.

Two speed-up units live here: ``zero_init_residual`` (Goyal et al. 2017, used by fast.ai's DAWNBench
run: the last BN gamma of every residual block starts at 0, so each block starts as the identity and
large-batch training is stable early) and ``channels_last`` (NHWC memory, which lets cuDNN use the
tensor-core convolution kernels without transposes).
"""

from __future__ import annotations

import torch
from torch import nn

from lightray.config import TIMM_PREFIX, ModelConfig, check_arch
from lightray.train.device import unwrap_model  # noqa: F401  (re-exported)
from lightray.units import unit_log


def _conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock, with its parameter names (``conv1``, ``bn1``, ``conv2``, ``bn2``,
    ``downsample``), so weights and checkpoints are interchangeable. Written here because importing torchvision
    costs about 2 s a process on this 2-core machine (torchvision.ops pulls in torch._dynamo), paid by the driver
    and every Train worker of a run that never uses a torchvision model."""

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv3x3(in_ch, out_ch, stride)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(out_ch, out_ch)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


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


class ScaleFreeBN(nn.BatchNorm2d):
    """BatchNorm with a learned shift but a fixed scale of 1 and fast statistics (momentum 0.4): the fast CIFAR-10
    trainers' choice (hlb-cifar10, airbench). A learned scale after a ReLU-like unit adds nothing a short run can
    use, and fast statistics track weights that move a lot in a few epochs."""

    def __init__(self, channels: int):
        super().__init__(channels, eps=1e-12, momentum=0.4)
        self.weight.requires_grad_(False)


class CifarVGG(nn.Module):
    """A network shaped for 32 px photos, after the fast CIFAR-10 trainers (hlb-cifar10, airbench94): a 2x2 stem
    conv (32 -> 31 px), three groups of [3x3 conv, 2x2 max-pool, BN, GELU, 3x3 conv, BN, GELU], a global max-pool
    and a bias-free linear head scaled by 1/9 (small initial logits). No residuals: at 4 x 4 px after three
    pools a plain VGG trains fastest per second. Widths 64/256/256 are airbench94's (about 1.97 M parameters)."""

    def __init__(self, num_classes: int, widths: tuple[int, ...] = (64, 256, 256)):
        super().__init__()
        stem = 24  # airbench's 2 x 3 x 2 x 2: one channel per sign of each whitening direction of 2x2 patches
        layers: list[nn.Module] = [nn.Conv2d(3, stem, 2, bias=True), nn.GELU()]
        c = stem
        for w in widths:
            layers += [nn.Conv2d(c, w, 3, padding=1, bias=False), nn.MaxPool2d(2), ScaleFreeBN(w), nn.GELU(),
                       nn.Conv2d(w, w, 3, padding=1, bias=False), ScaleFreeBN(w), nn.GELU()]
            c = w
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveMaxPool2d(1)
        self.fc = nn.Linear(c, num_classes, bias=False)
        for m in self.modules():
            if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3):
                # Partly identity (airbench's dirac init): the first in_channels filters start by passing their
                # input channel on, so the deep plain stack trains from the first steps.
                with torch.no_grad():
                    nn.init.dirac_(m.weight[:m.in_channels])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1)) / 9.0


def residual_last_bns(model: nn.Module) -> list[nn.BatchNorm2d]:
    """The BN closing the residual branch of every block (bn2 of a BasicBlock, bn3 of a Bottleneck)."""
    out: list[nn.BatchNorm2d] = []
    blocks = (BasicBlock, *_torchvision_blocks())
    for m in model.modules():
        if not isinstance(m, blocks):
            continue
        out.append(m.bn3 if hasattr(m, "bn3") else m.bn2)  # a Bottleneck closes on bn3, a BasicBlock on bn2
    return out


def _torchvision_blocks() -> tuple[type, ...]:
    """torchvision's residual blocks, when torchvision is already loaded (a torchvision model was built): a model
    of lightray's own has none, so it need not import it."""
    import sys

    resnet = sys.modules.get("torchvision.models.resnet")
    return (resnet.BasicBlock, resnet.Bottleneck) if resnet is not None else ()


def _create(arch: str, num_classes: int, zero_init_residual: bool, widths: tuple[int, ...] = ()) -> nn.Module:
    family = check_arch(arch)
    if family == "lightray":
        net = CifarVGG if arch == "cifar_vgg" else TinyResNet
        return net(num_classes, widths) if widths else net(num_classes)
    if family == "torchvision":
        import torchvision  # only for its models: it costs every process about 2 s to import

        # zero_init_residual is applied by build_model for every arch the same way, so it is not passed here.
        return torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
    import timm

    name = arch[len(TIMM_PREFIX):]
    try:  # timm's ResNets zero their last BN by default; follow model.zero_init_residual instead
        return timm.create_model(name, pretrained=False, num_classes=num_classes, zero_init_last=zero_init_residual)
    except TypeError:  # models without that argument
        return timm.create_model(name, pretrained=False, num_classes=num_classes)


def _zero_init(model: nn.Module, arch: str, on: bool) -> None:
    bns = residual_last_bns(model)
    # timm's residual blocks (ResNet, RegNet, ...) each know their last norm layer: zero_init_last().
    timm_blocks = [m for m in model.modules() if callable(getattr(m, "zero_init_last", None))]
    if not bns and not timm_blocks:
        unit_log("zero_init_residual", f"not applicable to {arch}: no residual blocks with a known last BN",
                 blocks=0)
        return
    if not on:
        unit_log("zero_init_residual", "off (model.zero_init_residual=false): BN gammas start at 1", blocks=0)
        return
    for bn in bns:
        nn.init.zeros_(bn.weight)
    for block in timm_blocks:
        block.zero_init_last()
    n = len(bns) + len(timm_blocks)
    unit_log("zero_init_residual", f"zeroed the last BN gamma of {n} residual blocks", blocks=n)


def build_model(cfg: ModelConfig, num_classes: int) -> nn.Module:
    """The network named by ``cfg.arch`` with ``num_classes`` outputs: randomly initialised, or with the
    weights named by ``cfg.pretrained`` (the head re-initialised when the class count differs)."""
    if num_classes < 1:
        raise ValueError(f"num_classes: bad value {num_classes}; expected at least 1")
    model = _create(cfg.arch, num_classes, cfg.zero_init_residual, tuple(cfg.widths))
    if cfg.global_bn:  # before the zero-init below, which must reach the swapped layers
        # Imported here: its custom op's registration makes torch scan every loaded module (inspect.getmodule),
        # about 50-90 ms of every driver and Train worker start, for a switch that is off by default.
        from lightray.comm.global_bn import to_global_bn

        model, n_bn, kind = to_global_bn(model)
        unit_log("global_bn", f"{n_bn} BN layers normalise over the global batch as {kind} (one all-reduce each "
                 "per forward and backward when there is more than one worker)", layers=n_bn, kind=kind)
    else:
        unit_log("global_bn", "off (model.global_bn=false): each worker normalises its own share of the batch",
                 layers=0)
    _zero_init(model, cfg.arch, cfg.zero_init_residual)
    if cfg.whiten_stem:
        from lightray.train.whiten import freeze_stem

        freeze_stem(model)  # before DDP and the optimiser see which parameters train
        unit_log("whiten_stem", "stem weight frozen; a fresh run sets it from its first batch's whitened patches",
                 enabled=True)
    else:
        unit_log("whiten_stem", "off (model.whiten_stem=false)", enabled=False)
    n_params = sum(p.numel() for p in model.parameters())
    unit_log("model", f"{cfg.arch}: {n_params / 1e6:.2f}M parameters, {num_classes} classes", params=n_params)
    if getattr(cfg, "pretrained", ""):
        from lightray.train.finetune import load_pretrained

        load_pretrained(model, cfg.pretrained, cfg.arch)
    return model


def to_device(model: nn.Module, device: torch.device, cfg: ModelConfig) -> nn.Module:
    """Move ``model`` to ``device``, in channels_last memory when ``cfg.channels_last`` is on.

    Inputs must then be channels_last too (``lightray.train.device.images_to_device`` does that) or every
    conv pays a layout conversion.
    """
    model = model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
        unit_log("channels_last", f"model weights in channels_last (NHWC) on {device.type}", enabled=True)
    else:
        unit_log("channels_last", "off (model.channels_last=false): contiguous NCHW", enabled=False)
    return model
