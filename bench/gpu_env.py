"""Versions, the GPU, and nvJPEG decode timed: the first step of bench/gpu_suite.sh.

Prints the stack's versions, ``nvidia-smi``'s view and ``torch.cuda``'s device properties (to stderr, for the
log), then times ``torchvision.io.decode_jpeg`` on the device for one image and for a list of ``--batch``
images (batched nvJPEG on CUDA). One JSON line on stdout.

    python -m bench.gpu_env               # on the GPU machine
    python -m bench.gpu_env --dry-run     # the same code on the CPU device, tiny sizes
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch
from PIL import Image

from bench.common import Machine, emit, note


def jpeg_bytes(n: int, size: tuple[int, int], seed: int = 0) -> list[torch.Tensor]:
    """``n`` smooth random JPEGs of ``size`` (w, h) as uint8 byte tensors, what decode_jpeg takes."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        small = (rng.random((size[1] // 16, size[0] // 16, 3)) * 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(small).resize(size, Image.Resampling.BILINEAR).save(buf, format="JPEG", quality=90)
        out.append(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_decode(data: list[torch.Tensor], device: torch.device, reps: int) -> dict[str, Any]:
    """Images/s of decode_jpeg for one image and for the whole list in one call, best of ``reps`` after a
    warm-up call each (the first nvJPEG call pays its handle and buffers)."""
    from torchvision.io import decode_jpeg

    def best(fn) -> float:
        fn()
        _sync(device)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        return min(times)

    one = best(lambda: decode_jpeg(data[0], device=device))
    many = best(lambda: decode_jpeg(data, device=device))
    return {"single_ms": round(one * 1e3, 3), "single_img_s": round(1 / one, 1),
            "batched_n": len(data), "batched_ms": round(many * 1e3, 2), "batched_img_s": round(len(data) / many, 1),
            "batched_over_single": round((len(data) / many) / (1 / one), 2), "reps": reps, "device": device.type}


def gpu_props() -> dict[str, Any]:
    p = torch.cuda.get_device_properties(0)
    return {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1),
            "sm_count": p.multi_processor_count, "count": torch.cuda.device_count(), "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "bf16": torch.cuda.is_bf16_supported()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_env", description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256, help="images in the batched decode call")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true", help="the CPU device, tiny sizes: checks the script")
    args = ap.parse_args(argv)
    machine = Machine()
    import torchvision

    figures: dict[str, Any] = {"torch": torch.__version__, "torchvision": torchvision.__version__,
                               "cuda_available": torch.cuda.is_available()}
    try:
        import ray

        figures["ray"] = ray.__version__
    except ImportError:
        figures["ray"] = "absent"
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
        sys.stderr.write(smi.stdout + smi.stderr)  # the whole table goes to the log
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        figures["nvidia_smi"] = q.stdout.strip()
    else:
        figures["nvidia_smi"] = None
    if args.dry_run:
        device, args.batch, args.reps, size = torch.device("cpu"), 8, 1, (128, 96)
    else:
        if not torch.cuda.is_available():
            ap.error("no CUDA device visible; use --dry-run to check the script on CPU")
        device, size = torch.device("cuda"), (500, 375)
        figures["gpu"] = gpu_props()
    note(f"decode_jpeg on {device}: 1 and {args.batch} images of {size[0]}x{size[1]}")
    data = jpeg_bytes(args.batch, size)
    figures["jpeg_kb_median"] = round(statistics.median(d.numel() for d in data) / 1024, 1)
    figures["decode"] = time_decode(data, device, args.reps)
    figures["decode"]["image_size"] = list(size)
    emit("gpu_env", figures, {"decode_batched_over_single": figures["decode"]["batched_over_single"]},
         machine.finish(argv, dry_run=args.dry_run, device=device.type))
    return 0


if __name__ == "__main__":
    sys.exit(main())
