"""Gradient accumulation: each global batch in micro-steps that fit one device (``scaling.max_batch_per_device``).

A phase's ``batch_size`` stays the global batch: the LR, the schedule, the epoch plan and the sample audit
are functions of samples seen and never see the micro-steps. Each rank still receives its ``rank_slice`` of
every global batch as one Ray Data batch (so the data stream, its resume positions and the audit are those
of a run without accumulation) and the trainer cuts that slice into ``micro_steps`` contiguous micro-batches
of at most the cap. Each runs forward and backward with its loss weighted by its share of the slice, under
DDP's ``no_sync`` except the last, whose backward all-reduces the summed gradients; then one optimizer step.

Every rank runs the same number of micro-steps: the number is a function of the global batch, the worker
count and a cap agreed across ranks (the smallest rank's), so DDP's all-reduce and global BatchNorm's
per-forward all-reduces line up on every rank.

Batch statistics: plain BatchNorm normalises each micro-batch by itself, as a worker whose whole share is
one micro-batch does. W workers x M micro-steps of b therefore take the steps of W*M workers of b, not those
of W workers of M*b; with ``model.global_bn`` the statistics span one micro-step of every rank.

``auto`` on CUDA (:func:`activation_bytes_per_image`, :func:`cap_from_memory`): the activations a training
step keeps for the backward pass are, for convolutional networks, about the sum of every leaf module's
output (measured here: ResNet-50 at 224 px keeps 122 MB an image in fp32, and its leaf outputs sum to 122 MB).
That sum is measured by one no-grad forward of a single image at the phase's resolution, in eval mode and
under the run's autocast (so bf16 outputs count 2 bytes), times :data:`ACTIVATION_FACTOR` for the backward's
transient gradients. The memory it may use is what the device has free now (plus what PyTorch's allocator
holds unused), less the optimizer state not yet allocated, the in-flight copies of the uint8 batch and
:data:`FIXED_RESERVE_BYTES` for cuDNN workspaces, NCCL buffers and fragmentation; the cap is
:data:`MEMORY_FRACTION` of that divided by the per-image bytes, rounded down to a multiple of 8. On the CPU
``auto`` means no cap: host memory is rarely what limits a CPU run, and a CPU run that needs one sets it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightray.data.plan import rank_slice
from lightray.train import device as dev

ACTIVATION_FACTOR = 1.25  # kept activations -> peak: the backward's gradient buffers of the widest layers
MEMORY_FRACTION = 0.85  # of the estimated budget; the rest absorbs estimate error
FIXED_RESERVE_BYTES = 1 << 30  # cuDNN workspaces, NCCL buffers, allocator fragmentation
INFLIGHT_BATCHES = 3  # uint8 slices on the device at once: the one in use, the one copied ahead, the next
_NO_CAP = 2**62


@dataclass(frozen=True)
class MicroPlan:
    """How one phase's global batch is taken: ``world`` workers x ``micro_steps`` micro-steps x at most
    ``micro_batch`` images."""

    phase: int
    global_batch: int
    world: int
    micro_steps: int
    micro_batch: int  # the largest micro-batch of any rank
    cap: int  # the agreed max_batch_per_device; 0 = no cap
    how: str  # where the cap came from

    def describe(self) -> str:
        """The unit line, e.g. ``phase 0: global batch 8192 = 4 workers x 4 micro-steps x 512``."""
        even = self.global_batch == self.world * self.micro_steps * self.micro_batch
        line = (f"phase {self.phase}: global batch {self.global_batch} = {self.world} "
                f"worker{'s' if self.world != 1 else ''} x {self.micro_steps} "
                f"micro-step{'s' if self.micro_steps != 1 else ''} x {'' if even else 'up to '}{self.micro_batch}")
        if self.micro_steps == 1:
            return f"{line}; no accumulation: each worker's share fits ({self.how})"
        return f"{line}; gradients accumulate under DDP no_sync, one optimizer step per global batch ({self.how})"

    def event(self) -> dict[str, Any]:
        """The ``unit`` event fields."""
        return {"unit": "accumulation", "message": self.describe(), "phase": self.phase,
                "global_batch": self.global_batch, "workers": self.world, "micro_steps": self.micro_steps,
                "micro_batch": self.micro_batch, "max_batch_per_device": self.cap, "how": self.how}


def micro_steps_for(global_batch: int, world: int, cap: int) -> int:
    """Micro-steps per optimizer step: enough that the largest rank share fits ``cap`` (0 = no cap: 1)."""
    largest = -(-global_batch // world)
    return max(1, -(-largest // cap)) if cap > 0 else 1


def micro_slices(n: int, steps: int) -> list[tuple[int, int]]:
    """``steps`` contiguous [start, end) parts of a share of ``n`` images, sizes differing by at most one.

    The larger parts come last: a part can be empty only when ``n < steps``, and then it is never the last
    one, whose backward is the one that all-reduces."""
    bounds, start = [], 0
    for k in range(steps):
        lo, hi = rank_slice(n, steps, steps - 1 - k)
        bounds.append((start, start + hi - lo))
        start += hi - lo
    return bounds


@torch.no_grad()
def activation_bytes_per_image(model: nn.Module, resolution: int, device: torch.device, precision: str,
                               channels_last: bool) -> int:
    """Bytes of activations a training step keeps per image at ``resolution``: the summed leaf outputs of one
    image's forward, times :data:`ACTIVATION_FACTOR` (see the module's notes). The model's mode, buffers
    and gradients are left as they were."""
    module = dev.unwrap_model(model)
    total = [0]

    def count(_mod: nn.Module, _inp: Any, out: Any) -> None:
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                total[0] += t.numel() * t.element_size()

    leaves = [m for m in module.modules() if not any(True for _ in m.children())]
    hooks = [m.register_forward_hook(count) for m in leaves]
    was_training = module.training
    try:
        module.eval()  # no running-statistics update: the estimate leaves the model as it was
        x = torch.zeros(1, 3, resolution, resolution, device=device)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with dev.autocast(precision, device):
            module(x)
    finally:
        for h in hooks:
            h.remove()
        module.train(was_training)
    return int(total[0] * ACTIVATION_FACTOR)


def cap_from_memory(free_bytes: int, per_image_bytes: int, reserve_bytes: int) -> int:
    """Images per device that fit ``MEMORY_FRACTION`` of ``free_bytes - reserve_bytes`` at ``per_image_bytes``
    each: a multiple of 8 (tensor-core friendly) when at least 8 fit, and never below 1."""
    fits = int(MEMORY_FRACTION * max(0, free_bytes - reserve_bytes) // max(1, per_image_bytes))
    return max(1, fits - fits % 8 if fits >= 8 else fits)


def resolve_cap(setting: str, model: nn.Module, resolution: int, device: torch.device, precision: str,
                channels_last: bool, share: int) -> tuple[int, str]:
    """This rank's cap for a phase at ``resolution`` (0 = none) and how it was chosen; ``share`` is the rank's
    images per global batch (its whole uint8 slice sits on the device while it is cut into micro-batches)."""
    if setting != "auto":
        cap = int(setting)
        return cap, ("scaling.max_batch_per_device=0: no cap" if cap == 0 else
                     f"scaling.max_batch_per_device={cap} set by hand")
    if device.type != "cuda":
        return 0, f"scaling.max_batch_per_device=auto: no cap on {device.type}"
    per_image = activation_bytes_per_image(model, resolution, device, precision, channels_last)
    free, _total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # held by PyTorch, unused
    # Optimizer state is allocated at the first step (two moments for LAMB: twice the parameters at most).
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    inflight = INFLIGHT_BATCHES * share * 3 * resolution * resolution
    reserve = 2 * params + inflight + FIXED_RESERVE_BYTES
    cap = cap_from_memory(free, per_image, reserve)
    return cap, (f"scaling.max_batch_per_device=auto on {device}: {free / 2**30:.1f} GiB free less "
                 f"{reserve / 2**30:.1f} GiB reserved, {per_image / 2**20:.1f} MB of activations an image at "
                 f"{resolution}px in {precision}")


def agree_cap(cap: int, device: torch.device) -> int:
    """The smallest cap of any rank (0 = none anywhere), so that every rank runs the same micro-steps.

    A collective: every rank calls it at the same point."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return cap
    t = torch.tensor([cap if cap > 0 else _NO_CAP], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    agreed = int(t.item())
    return 0 if agreed >= _NO_CAP else agreed


def plan_phase(phase: int, global_batch: int, world: int, cap: int, how: str, global_bn: bool = False) -> MicroPlan:
    """The micro-step plan of a phase for an agreed ``cap``."""
    steps = micro_steps_for(global_batch, world, cap)
    largest_share = -(-global_batch // world)
    plan = MicroPlan(phase, global_batch, world, steps, -(-largest_share // steps), cap, how)
    if global_bn and world > 1 and global_batch // world < steps:
        # A rank with fewer images than micro-steps skips an empty one; global BN's all-reduce in that forward
        # would then wait for it forever.
        raise ValueError(f"scaling.max_batch_per_device={cap}: {plan.describe()} leaves a rank an empty "
                         f"micro-step, which model.global_bn cannot skip; use a cap of at least 2")
    return plan
