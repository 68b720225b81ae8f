"""Training images/s of one GPU on synthetic data: plain PyTorch vs lightray's device units, side by side.

Variants, all through the same step (uint8 NHWC batch already on the device -> normalize -> forward ->
label-smoothed CE -> backward -> SGD+Nesterov step):
  plain             fp32, contiguous NCHW, cudnn.benchmark off, zero-init off, torch's default SGD kernel
  lightray          bf16 autocast (fp16 + scaler on GPUs without bf16), channels_last, cudnn.benchmark,
                    fused SGD -- the units of app/train/{device,model,optim}.py
  lightray_compile  lightray + torch.compile (GPU only; eager on CPU, reported as compile_applied=false)
  plain_bf16        plain PyTorch done right: bf16 autocast (the precision lightray's auto picks), channels_last,
                    cudnn.benchmark and TF32 on, torch's fused SGD kernel on CUDA (lightray's), zero-init off --
                    the fair comparator for lightray (plain fp32 flatters it)
  plain_bf16_compile  plain_bf16 + plain ``torch.compile(model)``, the comparator for lightray_compile

Reference: NVIDIA's PyTorch ResNet-50 v1.5 AMP training reaches about 2,500 img/s on one A100 80GB;
the target for one H200 is >= 3,000.

    python -m bench.gpu_throughput                 # ResNet-50, 224 px, batch 256 on cuda
    python -m bench.gpu_throughput --cpu-dry-run   # tiny sizes on CPU, to test the script

Prints one JSON line: {"bench": "gpu_throughput", "figures": ..., "ratios": ..., "machine": ...}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common import Machine, emit
from lightray.config import ModelConfig, OptimConfig
from lightray.train import device as dev
from lightray.train.model import build_model, to_device
from lightray.train.optim import build_loss, build_optimizer, set_lr_momentum

REFERENCE_A100_AMP_IMG_S = 2500.0
TARGET_H200_IMG_S = 3000.0
VARIANTS = ("plain", "lightray", "lightray_compile", "plain_bf16", "plain_bf16_compile")


def _r(x: float) -> float:
    """Four significant digits: enough for a speed figure, readable at any scale (CPU dry runs are < 1)."""
    return float(f"{x:.4g}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _variant_configs(name: str, args: argparse.Namespace,
                     device: torch.device) -> tuple[ModelConfig, OptimConfig, bool]:
    """(model config, optimiser config, whether the variant is plain PyTorch) of variant ``name``; on CUDA also
    sets cuDNN's benchmark and TF32 as that variant would."""
    plain = name.startswith("plain")  # torch's SGD, no zero-init: plain PyTorch in every plain* variant
    fp32_plain = name == "plain"  # the out-of-the-box baseline: fp32, NCHW, cudnn.benchmark off
    mcfg = ModelConfig(arch=args.arch, zero_init_residual=not plain, channels_last=not fp32_plain,
                       compile=name.endswith("_compile"), precision="fp32" if fp32_plain else "auto")
    ocfg = OptimConfig(name="sgd", fused=not plain, label_smoothing=0.1)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False  # torch's default, for the plain variant
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = True  # torch's default for convolutions
        if not plain:
            dev.enable_cudnn_benchmark(mcfg, device)
        elif not fp32_plain:
            # What a careful plain-PyTorch user sets by hand, and what lightray's tf32 default sets: the same
            # TF32 on both sides, so the ratio is not TF32's.
            torch.backends.cudnn.benchmark = True
            torch.backends.cuda.matmul.allow_tf32 = True
    return mcfg, ocfg, plain


def _optimizer(model: torch.nn.Module, ocfg: OptimConfig, plain: bool, device: torch.device,
               fused: bool = False) -> torch.optim.Optimizer:
    """The variant's optimiser at LR 0.1 and momentum 0.9: torch's own SGD for plain variants (its fused kernel
    with ``fused``, which lightray's SGD uses on CUDA; else torch's default, foreach on CUDA), lightray's else."""
    if plain:  # torch's SGD, decay on every tensor
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                                                     weight_decay=5e-5, **({"fused": True} if fused else {}))
    else:
        opt = build_optimizer(model, ocfg, device)
    set_lr_momentum(opt, 0.1, 0.9)
    return opt


def _batches(args: argparse.Namespace, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three seeded random uint8 image batches (NHWC) and their labels, on ``device``."""
    g = torch.Generator(device="cpu").manual_seed(1)
    # Several batches in rotation so the timing is not of one cached input (METHOD: rotate inputs).
    images = [torch.randint(0, 256, (args.batch, args.res, args.res, 3), dtype=torch.uint8, generator=g).to(device)
              for _ in range(3)]
    labels = [torch.randint(0, args.classes, (args.batch,), generator=g).to(device) for _ in range(3)]
    return images, labels


def _timed(step: Callable[[int], torch.Tensor], args: argparse.Namespace,
           device: torch.device) -> tuple[float, list[float], torch.Tensor]:
    """``--warmup`` untimed steps, then ``--windows`` timed windows of ``--steps``: (warm-up seconds, images/s
    per window, the last step's loss)."""
    t0 = time.perf_counter()
    for i in range(args.warmup):
        loss = step(i)
    _sync(device)
    warmup_s = time.perf_counter() - t0
    rates = []
    for _ in range(args.windows):
        t = time.perf_counter()
        for i in range(args.steps):
            loss = step(i)
        _sync(device)
        rates.append(args.batch * args.steps / (time.perf_counter() - t))
    return warmup_s, rates, loss


def run_variant(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    mcfg, ocfg, plain = _variant_configs(name, args, device)
    torch.manual_seed(0)
    model = to_device(build_model(mcfg, args.classes), device, mcfg)
    precision = dev.precision_for(mcfg, device)
    scaler = dev.make_grad_scaler(precision, device)
    # Plain PyTorch done right takes the fused kernel where lightray does (CUDA); the out-of-the-box plain fp32
    # keeps torch's default.
    fused_plain = plain and name != "plain" and device.type == "cuda"
    opt = _optimizer(model, ocfg, plain, device, fused=fused_plain)
    loss_fn = build_loss(ocfg)
    if plain:  # plain torch.compile, not lightray's wrapper; on the GPU only, as lightray compiles
        step_model = torch.compile(model) if mcfg.compile and device.type == "cuda" else model
    else:
        step_model = dev.maybe_compile(model, mcfg, device)
    compile_applied = step_model is not model
    images, labels = _batches(args, device)

    def step(i: int) -> torch.Tensor:
        x = dev.images_to_device(images[i % 3], device, channels_last=mcfg.channels_last)
        with dev.autocast(precision, device):
            loss = loss_fn(step_model(x), labels[i % 3])
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    model.train()
    warmup_s, rates, loss = _timed(step, args, device)
    final_loss = float(loss.detach().float())
    if not torch.isfinite(torch.tensor(final_loss)):
        raise RuntimeError(f"{name}: loss became {final_loss}")
    out = {"img_s": statistics.median(rates), "img_s_min": min(rates), "img_s_max": max(rates),
           "warmup_s": warmup_s, "precision": precision, "compile_applied": compile_applied, "loss": final_loss,
           "sgd_kernel": "fused" if (fused_plain or (not plain and ocfg.fused and device.type == "cuda")) else
           "default", "tf32_matmul": device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32}
    if device.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    return out  # the model, optimiser and batches go with this frame; main() empties the CUDA cache


def device_info(device: torch.device, dry_run: bool) -> dict[str, Any]:
    """What the common machine section lacks: the device, and the GPU stack when there is one."""
    info: dict[str, Any] = {"device": str(device.type), "dry_run": dry_run}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        info["cudnn"] = torch.backends.cudnn.version()
    return info


def build_parser() -> argparse.ArgumentParser:
    """The bench's command line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="resnet50", choices=["resnet_tiny", "resnet18", "resnet34", "resnet50"])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=15, help="untimed steps (compile, cuDNN search)")
    p.add_argument("--steps", type=int, default=30, help="steps per timed window")
    p.add_argument("--windows", type=int, default=3, help="timed windows; the median is reported")
    p.add_argument("--variants", default="plain,lightray,lightray_compile")
    p.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on CPU: checks the script, times nothing")
    return p


def measure(variants: list[str], args: argparse.Namespace, device: torch.device,
            figures: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Run every variant in turn; a failing one is recorded as ``figures[<variant>_error]`` and the rest go on.
    Exits when every variant failed."""
    results: dict[str, dict[str, Any]] = {}
    for v in variants:
        try:
            results[v] = run_variant(v, args, device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as exc:  # one broken variant (say, compile on a new stack) must not hide the others
            figures[f"{v}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"gpu_throughput: variant {v} failed: {exc!r}", file=sys.stderr)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if not results:
        raise SystemExit("gpu_throughput: every variant failed; see the errors above")
    return results


def _variant_figures(results: dict[str, dict[str, Any]], figures: dict[str, Any]) -> None:
    """Each variant's images/s, range, warm-up, precision, compile and peak memory, then the reference, the
    target and the best lightray variant over the target, into ``figures``."""
    for v, r in results.items():
        figures[f"{v}_img_s"] = _r(r["img_s"])
        figures[f"{v}_img_s_range"] = [_r(r["img_s_min"]), _r(r["img_s_max"])]
        figures[f"{v}_warmup_s"] = round(r["warmup_s"], 2)
        figures[f"{v}_precision"] = r["precision"]
        figures[f"{v}_sgd_kernel"], figures[f"{v}_tf32_matmul"] = r["sgd_kernel"], r["tf32_matmul"]
        figures[f"{v}_compile_applied"] = r["compile_applied"]
        if "peak_mem_gib" in r:
            figures[f"{v}_peak_mem_gib"] = round(r["peak_mem_gib"], 2)
    figures["reference_nvidia_a100_amp_img_s"] = REFERENCE_A100_AMP_IMG_S
    figures["target_h200_img_s"] = TARGET_H200_IMG_S
    mine = [r["img_s"] for v, r in results.items() if v.startswith("lightray")]
    best = max(mine) if mine else 0.0
    figures["best_over_target"] = _r(best / TARGET_H200_IMG_S)


def _ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Images/s ratios: every variant over plain, lightray over plain PyTorch done right, compile over eager."""
    ratios = {}
    if "plain" in results:
        for v in results:
            if v != "plain":
                ratios[f"{v}_over_plain"] = _r(results[v]["img_s"] / results["plain"]["img_s"])
    # Against plain PyTorch done right, at the same compile setting: the ratio that says what lightray adds.
    for mine_v, theirs_v in (("lightray", "plain_bf16"), ("lightray_compile", "plain_bf16_compile")):
        if mine_v in results and theirs_v in results:
            ratios[f"{mine_v}_over_{theirs_v}"] = _r(results[mine_v]["img_s"] / results[theirs_v]["img_s"])
    if "lightray" in results and "lightray_compile" in results:
        ratios["compile_over_eager"] = _r(results["lightray_compile"]["img_s"] / results["lightray"]["img_s"])
    return ratios


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = build_parser()
    args = p.parse_args(argv)
    machine = Machine()
    if args.cpu_dry_run:
        device = torch.device("cpu")
        args.batch, args.res, args.classes, args.warmup, args.steps, args.windows = 2, 32, 10, 1, 1, 1
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device visible; use --cpu-dry-run to check the script on CPU")
        device = dev.select_device()
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {bad}; allowed: {', '.join(VARIANTS)}")
    figures: dict[str, Any] = {"arch": args.arch, "batch": args.batch, "resolution": args.res}
    results = measure(variants, args, device, figures)
    _variant_figures(results, figures)
    ratios = _ratios(results)
    return emit("gpu_throughput", figures, ratios, machine.finish(argv, **device_info(device, args.cpu_dry_run)))


if __name__ == "__main__":
    main()
