"""Device placement and the device speed-up units (mixed precision, cuDNN autotune, TF32, compile).

Every unit here is one function that decides from the config and the device, does its thing, and says
what it did in one line through :func:`unit_log` (also when it was off or not applicable on this
device), so a run's log shows which speed-ups were really active. The worker loop drains those lines
with ``lightray.units.pop_unit_events`` and writes them to ``metrics.jsonl`` as ``{"event": "unit", ...}``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch import nn

from lightray.config import ConfigError, ModelConfig
from lightray.units import unit_log

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def select_device() -> torch.device:
    """``cuda:<local rank>`` when a GPU is visible, else ``cpu``.

    Inside a Ray Train worker Ray has already set ``CUDA_VISIBLE_DEVICES`` and knows which of the visible
    GPUs is ours, so its answer wins; outside (tests, benchmarks) fall back to ``LOCAL_RANK``.
    """
    if not torch.cuda.is_available():
        unit_log("device", "no CUDA device visible; using cpu", device="cpu")
        return torch.device("cpu")
    device: torch.device | None = None
    try:
        import ray.train.torch as rtt  # only imported on GPU hosts: ray's import costs seconds

        device = rtt.get_device()
        how = "ray.train.torch.get_device()"
    except Exception:  # not inside a Ray Train worker (or an older Ray): use the launcher's local rank
        device = None
    if device is None or device.type != "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        how = "LOCAL_RANK"
    torch.cuda.set_device(device)
    unit_log("device", f"using {device} ({torch.cuda.get_device_name(device)}) from {how}", device=str(device))
    return device


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend for this device type."""
    return "nccl" if device.type == "cuda" else "gloo"


# The CPU flags that mean bf16 arithmetic in hardware (AVX-512 BF16 on Cooper Lake, Sapphire Rapids and
# AMD Zen 4 and later; AMX on Sapphire Rapids and later). oneDNN then runs bf16 convolutions and matrix
# products natively; without them it emulates bf16, which is slower than fp32.
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """Which of :data:`CPU_BF16_FLAGS` the CPU reports (Linux's ``/proc/cpuinfo``); none where it is unreadable."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.partition(":")[2].split())
                    return [flag for flag in CPU_BF16_FLAGS if flag in have]
    except OSError:
        pass
    return []


def precision_for(cfg: ModelConfig, device: torch.device) -> str:
    """Resolve ``model.precision`` for this device: ``fp32``, ``bf16`` or ``fp16``.

    ``auto`` picks bf16 on a GPU that supports it (no loss scaling needed), fp16 on an older GPU (V100,
    T4: the DAWNBench-era setting, with a grad scaler). On a CPU it picks bf16 where the CPU has bf16 in
    hardware (:func:`cpu_bf16_flags`: the imagenette recipe's step ran 1.95x as fast as fp32 on a 2-core
    Zen 4, ``python -m bench.precision``) and fp32 elsewhere, where CPU autocast emulates bf16 and is slower.
    """
    want = cfg.precision
    cuda = device.type == "cuda"
    bf16_ok = cuda and torch.cuda.is_bf16_supported()
    why = ""
    if want == "auto" and cuda:
        got = "bf16" if bf16_ok else "fp16"
    elif want == "auto":
        flags = cpu_bf16_flags()
        got = "bf16" if flags else "fp32"
        why = f"; the CPU has {', '.join(flags)}" if flags else f"; the CPU has none of {', '.join(CPU_BF16_FLAGS)}"
    elif want == "fp16" and not cuda:
        raise ConfigError("model.precision: bad value 'fp16' on cpu; fp16 needs a CUDA GPU (use auto, fp32 or bf16)")
    elif want == "bf16" and cuda and not bf16_ok:
        raise ConfigError(
            f"model.precision: bad value 'bf16'; {torch.cuda.get_device_name(device)} has no bf16 support "
            "(use auto, fp16 or fp32)"
        )
    else:
        got = want
    if got == "fp32":
        unit_log("precision", f"mixed precision off: fp32 on {device.type} (model.precision={want}{why})",
                 precision=got)
    else:
        unit_log("precision", f"autocast to {got} on {device.type} (model.precision={want}{why})", precision=got)
    return got


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """A context manager running the forward pass in ``precision`` (a no-op for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision not in _DTYPES:
        raise ValueError(f"precision: bad value {precision!r}; expected fp32, bf16 or fp16")
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


def make_grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A loss scaler, enabled only for fp16 (bf16 has fp32's exponent range and needs none).

    A disabled scaler's ``scale``/``step``/``update`` are pass-throughs, so the loop is the same code
    for every precision.
    """
    enabled = precision == "fp16"
    scaler = torch.amp.GradScaler(device.type, enabled=enabled)
    if enabled:
        unit_log("grad_scaler", "dynamic loss scaling on for fp16", enabled=True)
    else:
        unit_log("grad_scaler", f"loss scaling off: not needed for {precision}", enabled=False)
    return scaler


def enable_cudnn_benchmark(cfg: ModelConfig | None = None, device: torch.device | None = None) -> bool:
    """Turn on cuDNN's per-shape algorithm search and TF32 for fp32 leftovers; True when cudnn_benchmark is on.

    Benchmark mode pays a search on each new input shape (once per phase resolution) and then runs the
    fastest kernels; with drop-last batches the shapes stay fixed within a phase.
    """
    want_bench = cfg.cudnn_benchmark if cfg is not None else True
    want_tf32 = cfg.tf32 if cfg is not None else True
    on_gpu = (device.type == "cuda") if device is not None else torch.cuda.is_available()
    if not on_gpu:
        unit_log("cudnn_benchmark", "not applicable on cpu; left off", enabled=False)
        return False
    torch.backends.cudnn.benchmark = bool(want_bench)
    # TF32 only matters for ops autocast leaves in fp32 (and for fp32 runs); Ampere and later only.
    torch.backends.cuda.matmul.allow_tf32 = bool(want_tf32)
    torch.backends.cudnn.allow_tf32 = bool(want_tf32)
    unit_log(
        "cudnn_benchmark",
        f"cudnn.benchmark={'on' if want_bench else 'off (model.cudnn_benchmark=false)'}, "
        f"tf32={'on' if want_tf32 else 'off'}",
        enabled=bool(want_bench),
        tf32=bool(want_tf32),
    )
    return bool(want_bench)


class CompiledForward(nn.Module):
    """The compiled model behind the shape policy: every call marks the batch dimension dynamic and the
    image's height and width static, then runs the compiled module.

    Why: a forward compiled for one batch size recompiles (and on a GPU searches cuDNN's algorithms again)
    for each new one, and a run meets many: each phase's per-rank share, each uneven share after an elastic
    resize, each micro-step of an accumulated share, each batch short of an image the device decode dropped.
    A dynamic batch dimension makes those one graph. The resolution is the opposite case: it changes only at
    a phase boundary, and a static one lets inductor pick kernels (and cuDNN algorithms) for that size, so
    each phase resolution is one compile. ``dynamic=True`` would make height and width symbolic too, and
    dynamo's automatic dynamic shapes would do the same at the first phase change; ``mark_static`` stops it.
    ``maybe_mark_dynamic`` rather than ``mark_dynamic``: a model that does need a fixed batch (one that
    reshapes by a constant) then recompiles, which the compile counts show, instead of failing the step.
    Two known exceptions: a batch of one image (PyTorch specialises sizes 0 and 1), and on a CPU inductor's
    C++ reductions, which guard on whether a reduction's size (a BN layer's batch x height x width) exceeds
    4096, so there one compile covers a range of batch sizes rather than all of them.
    """

    def __init__(self, compiled: nn.Module):
        super().__init__()
        self.compiled = compiled
        self.batch_sizes: set[int] = set()  # sizes seen since the last pop; a shape is host metadata, no sync

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch._dynamo

        torch._dynamo.maybe_mark_dynamic(x, 0)
        if x.dim() == 4:
            torch._dynamo.mark_static(x, 2)
            torch._dynamo.mark_static(x, 3)
        self.batch_sizes.add(int(x.shape[0]))
        return self.compiled(x)

    def pop_batch_sizes(self) -> list[int]:
        """The batch sizes the compiled forward ran since the last call, smallest first."""
        sizes = sorted(self.batch_sizes)
        self.batch_sizes.clear()
        return sizes


def maybe_compile(model: nn.Module, cfg: ModelConfig, device: torch.device) -> nn.Module:
    """``model`` compiled behind the shape policy (:class:`CompiledForward`) when ``model.compile`` is on and
    the device is a GPU, or a CPU with ``model.compile_on_cpu``; else ``model`` unchanged."""
    if not cfg.compile:
        unit_log("compile", "torch.compile off (model.compile=false)", enabled=False)
        return model
    if device.type != "cuda" and not cfg.compile_on_cpu:
        unit_log("compile", f"torch.compile not applicable on {device.type} (GPU only unless "
                            "model.compile_on_cpu=true); running eager", enabled=False)
        return model
    import torch._dynamo

    # Each phase resolution is one compile (the shape policy): allow enough of them that dynamo does not
    # silently fall back to eager for the last phase.
    limit_name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    if getattr(torch._dynamo.config, limit_name) < 32:
        setattr(torch._dynamo.config, limit_name, 32)
    compiled = torch.compile(model, mode=None if cfg.compile_mode == "default" else cfg.compile_mode)
    on_cpu = "; on cpu, batch sizes on either side of inductor's reduction-size guards are two compiles" \
        if device.type == "cpu" else ""
    unit_log("compile", f"torch.compile on {device.type} (mode={cfg.compile_mode}); shape policy: batch dimension "
                        "dynamic, height and width static: one compile per phase resolution whatever the per-rank "
                        "batch (a batch of one image is its own compile: PyTorch specialises sizes 0 and 1)"
                        f"{on_cpu}; evaluation runs eager", enabled=True, mode=cfg.compile_mode, device=device.type,
             dynamic_dims=["batch"], static_dims=["height", "width"])
    return CompiledForward(compiled)


def compile_counts() -> dict[str, Any]:
    """What dynamo has compiled in this process so far: ``compiles`` (graphs it captured and handed to the
    backend: a first compile, a recompile after a failed guard, or one more graph after a graph break) and
    ``graph_breaks`` with their reasons. Process-wide counters: a caller takes the difference of two reads."""
    from torch._dynamo.utils import counters

    reasons = {_break_reason(k): int(v) for k, v in counters["graph_break"].items()}
    return {"compiles": int(counters["stats"]["unique_graphs"]), "graph_breaks": sum(reasons.values()),
            "break_reasons": reasons}


def _break_reason(text: str) -> str:
    """A graph break's reason in one line: dynamo's explanation when it gives one, else its first line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    found = next((line[len("Explanation:"):].strip() for line in lines if line.startswith("Explanation:")),
                 lines[0] if lines else "?")
    return found.split(" in file ")[0][:200]  # a site-packages path says nothing a reader needs


def compile_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``after - before`` of two :func:`compile_counts` reads (break reasons whose count grew)."""
    grew = {k: v - before["break_reasons"].get(k, 0) for k, v in after["break_reasons"].items()}
    return {"compiles": after["compiles"] - before["compiles"],
            "graph_breaks": after["graph_breaks"] - before["graph_breaks"],
            "break_reasons": {k: v for k, v in grew.items() if v > 0}}


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device``; on CUDA through pinned memory, so the copy is really asynchronous
    (``non_blocking`` from pageable memory is a synchronous copy in disguise)."""
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


# (device, mean, std) -> the (1, 3, 1, 1) mean and std in pixel units on that device. Building them from Python
# floats is a host-to-device copy from pageable memory, which blocks the host: once per device, not per batch.
_NORM_CONSTANTS: dict[tuple[str, tuple[float, ...], tuple[float, ...]], tuple[torch.Tensor, torch.Tensor]] = {}


def _device_key(device: torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:<current>" are one device
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def normalization_constants(device: torch.device, mean: tuple[float, float, float] = IMAGENET_MEAN,
                            std: tuple[float, float, float] = IMAGENET_STD) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and std of :func:`images_to_device`'s normalisation, in [0, 255] pixel units, on ``device``:
    built at the first call for a device and kept (``normalization_cache()`` lists them)."""
    key = (_device_key(device), tuple(float(v) for v in mean), tuple(float(v) for v in std))
    found = _NORM_CONSTANTS.get(key)
    if found is None:
        found = (torch.tensor(key[1], device=device).view(1, 3, 1, 1) * 255.0,
                 torch.tensor(key[2], device=device).view(1, 3, 1, 1) * 255.0)
        _NORM_CONSTANTS[key] = found
    return found


def normalization_cache() -> dict[tuple[str, tuple[float, ...], tuple[float, ...]], tuple[torch.Tensor, torch.Tensor]]:
    """The normalisation constants made so far, by (device, mean, std)."""
    return dict(_NORM_CONSTANTS)


def _normalize(x: torch.Tensor, device: torch.device, channels_last: bool, mean: tuple[float, float, float],
               std: tuple[float, float, float]) -> torch.Tensor:
    m, s = normalization_constants(device, mean, std)
    x = (x - m) / s
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return x.contiguous(memory_format=fmt)


def images_to_device(
    images: torch.Tensor,
    device: torch.device,
    channels_last: bool,
    layout: str = "NHWC",
    mean: tuple[float, float, float] = IMAGENET_MEAN,
    std: tuple[float, float, float] = IMAGENET_STD,
) -> torch.Tensor:
    """uint8 images -> normalized float32 NCHW on ``device`` (channels_last memory when asked).

    The copy is done in uint8 (a quarter of the bytes of float32) and the normalization on the device.
    """
    if images.dtype != torch.uint8:
        raise ValueError(f"images: bad dtype {images.dtype}; expected torch.uint8")
    if images.dim() != 4 or layout not in ("NHWC", "NCHW"):
        raise ValueError(f"images: bad shape {tuple(images.shape)} / layout {layout!r}; expected 4-D NHWC or NCHW")
    x = host_to_device(images, device)
    if layout == "NHWC":
        x = x.permute(0, 3, 1, 2)  # a view: memory stays NHWC, which *is* channels_last for NCHW
    x = x.float()  # keeps the input's strides (NHWC memory stays channels_last)
    return _normalize(x, device, channels_last, mean, std)


def crop_resize_flip(images: torch.Tensor, boxes: torch.Tensor, flips: torch.Tensor, size: int) -> torch.Tensor:
    """Random-resized-crop + flip of a whole batch as one op on the tensors' device: uint8 NHWC canvases,
    (N, 4) boxes (x0, y0, x1, y1 in canvas pixels), (N,) flip bits -> float NCHW in [0, 255], ``size`` square.

    ``roi_align(aligned=True)`` samples at pixel centres as PIL's resize with a box does; with
    ``sampling_ratio=0`` each output pixel averages ceil(box/size) samples per axis, which approximates
    PIL's antialiased bilinear when the crop shrinks (and is plain bilinear when it grows)."""
    from torchvision.ops import roi_align  # torchvision's C++ ops load on first use

    x = images.permute(0, 3, 1, 2).float()
    idx = torch.arange(len(boxes), device=boxes.device, dtype=torch.float32).view(-1, 1)
    out = roi_align(x, torch.cat([idx, boxes.float()], dim=1), (size, size), spatial_scale=1.0, sampling_ratio=0,
                    aligned=True)
    return torch.where(flips.view(-1, 1, 1, 1), out.flip(3), out)


def augmented_to_device(
    images: torch.Tensor,
    boxes: torch.Tensor,
    flips: torch.Tensor,
    size: int,
    device: torch.device,
    channels_last: bool,
    mean: tuple[float, float, float] = IMAGENET_MEAN,
    std: tuple[float, float, float] = IMAGENET_STD,
) -> torch.Tensor:
    """The device path's batch: uint8 canvases + boxes + flip bits copied to ``device`` (uint8: the canvas's
    bytes, not float32's), cropped/resized/flipped there in one op, then normalized like
    :func:`images_to_device`."""
    if images.dtype != torch.uint8 or images.dim() != 4:
        raise ValueError(f"images: bad dtype/shape {images.dtype} {tuple(images.shape)}; expected uint8 NHWC")
    x = crop_resize_flip(host_to_device(images, device), host_to_device(boxes, device),
                         host_to_device(flips, device).bool(), size)
    return _normalize(x, device, channels_last, mean, std)


def log_augment_placement(augment_on: str, device: torch.device, device_phases: list[int]) -> None:
    """Say where training crops run on this worker: the device path (and on which device) or Ray Data tasks."""
    if augment_on == "device" and device_phases:
        label = "" if device.type == "cuda" else " (the device path on the CPU device)"
        unit_log("augment_on", f"crop+resize+flip of phases {device_phases} as one roi_align per batch on "
                               f"{device}{label}", on="device", device=device.type, phases=device_phases)
    else:
        unit_log("augment_on", f"training crops in Ray Data tasks on the CPU (resolved data.augment_on={augment_on})",
                 on="cpu", device=device.type, phases=[])


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module under DDP (``.module``), torch.compile (``._orig_mod``) and shape-policy wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(model, CompiledForward):
            model = model.compiled
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model
