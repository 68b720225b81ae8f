"""The whole stack on one GPU machine: real JPEGs through prepare, Ray Data and TorchTrainer into ResNet-50,
against the same model on synthetic data already on the device.

1. Generate a JPEG ImageFolder (``--images`` about 500x375, ``--classes`` classes), in parallel, offline.
2. ``python app/run.py`` (the real CLI: prepare, Ray Data ingest, TorchTrainer, NCCL with more than one GPU)
   on ResNet-50 (bf16 via precision auto, channels_last, torch.compile) for one epoch in each of the 128, 224
   and 288 px phases: a fixed number of steps each (images // batch).
3. The same model and step on synthetic uint8 batches already on the device (``bench.gpu_throughput``'s
   ``lightray_compile`` variant) at each phase's size and per-GPU batch.
   JPEG phases (above ``--raw-max``) run with ``data.decode_on=auto``: the start-up times the CPU path against
   batched nvJPEG on the GPU and picks one; the line says which, with both measurements (``decode_on``).
4. One JSON line: per phase, end-to-end img/s (median of the report windows after the first, which holds the
   compile), synthetic img/s, their ratio, data-wait fraction, GPU utilisation and peak GPU memory (sampled
   with nvidia-smi while the phase ran), and where the ratio is under 0.9, what starved the phase.

``--dry-run`` runs the same entry points on CPU with tiny sizes (ResNet-tiny, no compile, no GPU figures):
the test suite's check of this script. ``bash bench/gpu_e2e.sh`` is the GPU run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
from PIL import Image

from bench.common import REPO, Machine, emit, note

GOAL = 0.9  # end-to-end over synthetic, every phase
PHASES = [(128, 256, 0.35), (224, 192, 0.087), (288, 128, 0.5)]  # (px, per-GPU batch, min crop scale)
DRY_PHASES = [(32, 16, 0.35), (48, 16, 0.2), (64, 8, 0.5)]


def _write_chunk(args: tuple) -> int:
    root, start, stop, classes, size, seed = args
    rng = np.random.default_rng([seed, start])
    for i in range(start, stop):
        w, h = (int(s * rng.uniform(0.8, 1.2)) for s in size)
        if i % 5 == 0:
            w, h = h, w
        small = (rng.random((max(2, h // 16), max(2, w // 16), 3)) * 255).astype(np.uint8)
        folder = pathlib.Path(root) / f"c{i % classes:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(small).resize((w, h), Image.Resampling.BILINEAR).save(folder / f"{i:06d}.jpg", quality=90)
    return stop - start


def make_jpegs(root: pathlib.Path, n_train: int, n_val: int, classes: int, size: tuple[int, int],
               procs: int) -> None:
    """An ImageFolder of smooth random JPEGs around ``size`` (w, h), written by ``procs`` processes."""
    jobs = []
    for split, n in (("train", n_train), ("val", n_val)):
        step = max(1, -(-n // (procs * 4)))
        jobs += [(str(root / split), s, min(n, s + step), classes, size, 1 if split == "val" else 0)
                 for s in range(0, n, step)]
    with ProcessPoolExecutor(procs) as pool:
        list(pool.map(_write_chunk, jobs))


class GpuSampler:
    """nvidia-smi's utilisation and memory of GPU 0 every ``every_s``, with wall-clock times."""

    def __init__(self, every_s: float = 0.5):
        self.every_s, self.samples, self._stop = every_s, [], threading.Event()
        self.available = shutil.which("nvidia-smi") is not None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                                      "--format=csv,noheader,nounits", "-i", "0"], capture_output=True, text=True,
                                     timeout=5).stdout.split(",")
                self.samples.append((time.time(), float(out[0]), float(out[1])))
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                pass
            self._stop.wait(self.every_s)

    def __enter__(self) -> GpuSampler:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.available:
            self._thread.join()

    def between(self, t0: float, t1: float) -> dict[str, float | None]:
        got = [(u, m) for t, u, m in self.samples if t0 <= t <= t1]
        if not got:
            return {"gpu_util_pct": None, "peak_gpu_mem_gib": None}
        return {"gpu_util_pct": round(statistics.mean(u for u, _ in got), 1),
                "peak_gpu_mem_gib": round(max(m for _, m in got) / 1024, 2)}


def run_args(src: pathlib.Path, work: pathlib.Path, phases: list[tuple], gpus: int, dry: bool,
             raw_max: int) -> list[str]:
    """The ``python app/run.py`` command line: one epoch per phase, the dawnbench recipe's model units."""
    workers = max(1, gpus)
    phase_yaml = "[" + ", ".join(f"{{until_epoch: {i + 1}, resolution: {r}, batch_size: {b * workers}, min_scale: {m}}}"
                                 for i, (r, b, m) in enumerate(phases)) + "]"
    cores = os.cpu_count() or 1
    args = [sys.executable, "app/run.py", "--config", "imagenet-rn50-dawnbench", "--data", str(src),
            "--storage", str(work / "runs"), "--name", "e2e", "--workers", str(workers),
            "--gpu", "false" if dry else "true", "--scaling.ray_address=local",
            f"--data.cache_dir={work / 'cache'}", f"--data.local_cache_dir={work / 'local'}",
            f"--data.raw_max_resolution={raw_max}", "--data.val_mode=center", "--data.augment_on=auto",
            "--data.decode_on=auto",
            "--data.autotune_seconds=0" if dry else "--data.autotune_seconds=4",
            f"--schedule.phases={phase_yaml}", f"--schedule.epochs={len(phases)}", "--schedule.warmup_epochs=0.5",
            f"--schedule.eval_resolution={phases[-1][0]}", "--report.every_steps=5",
            "--checkpoint.every_minutes=0", "--checkpoint.keep=1",
            # One CPU per worker for the loop; the rest of the machine is Ray Data's.
            "--scaling.cpus_per_worker=1", f"--scaling.ray_num_cpus={cores}"]
    if dry:
        args += ["--model.arch=resnet_tiny", "--model.compile=false", "--model.precision=fp32"]
    return args


def phase_figures(records: list[dict], phases: list[tuple]) -> dict[int, dict[str, Any]]:
    """Per phase resolution: steady img/s (median of the windows after the first: the first holds compile
    and cuDNN's search), mean data-wait fraction and the wall-clock span of those windows."""
    out = {}
    for res, _b, _m in phases:
        wins = [r for r in records if "event" not in r and "val_top1" not in r and r.get("resolution") == res
                and "images_per_s" in r]
        steady = wins[1:] or wins
        if not steady:
            out[res] = {"e2e_img_s": None, "data_wait_frac": None, "t0": 0.0, "t1": 0.0, "windows": 0}
            continue
        out[res] = {"e2e_img_s": round(statistics.median(r["images_per_s"] for r in steady), 1),
                    "data_wait_frac": round(statistics.mean(r["data_wait_frac"] for r in steady), 3),
                    "t0": min(r.get("time", 0.0) for r in steady) - 1.0, "t1": max(r.get("time", 0.0) for r in steady),
                    "windows": len(steady)}
    return out


def decode_paths(records: list[dict]) -> dict[int, dict[str, Any]]:
    """Per phase index, where its JPEG tier was decoded (the driver's ``decode_on`` unit events): ``on``
    (cpu | device | object_store), the start-up's two measurements and its reason."""
    out = {}
    for r in records:
        if r.get("event") == "unit" and r.get("unit") == "decode_on" and "phase" in r:
            out[int(r["phase"])] = {"on": r.get("on"), "cpu_img_s_per_cpu": r.get("cpu_img_s_per_cpu"),
                                    "device_img_s": r.get("device_img_s"), "cpus_per_gpu": r.get("cpus_per_gpu"),
                                    "why": r.get("message", "")}
    return out


def starved_by(ratio: float | None, wait: float | None, util: float | None, device_aug: bool,
               device_decode: bool = False) -> str | None:
    """Why a phase fell short of the goal, from its own evidence; None when it met it."""
    if ratio is None:
        return "no steady report windows: the phase was too short to measure"
    if ratio >= GOAL:
        return None
    if wait is not None and wait > 1 - GOAL:
        where = ("window copies in Ray Data tasks" if device_aug else
                 "JPEG bytes passed through Ray Data tasks (decoded on the GPU)" if device_decode else
                 "JPEG decode + crop in Ray Data tasks (a raw tier and data.augment_on=device move the crop off the "
                 "CPUs; data.decode_on=device moves a JPEG tier's decode to the GPU)")
        return f"data: the worker waited on Ray Data {wait:.0%} of the time; the CPUs ({os.cpu_count()}) could not " \
               f"keep up with {where}"
    util_s = f"GPU busy {util:.0f}%" if util is not None else "GPU utilisation unknown"
    return f"not the data (waited {wait or 0:.0%}): per-step overhead in the loop (host copies, metrics, " \
           f"validation and checkpoint time inside the windows); {util_s}"


def synthetic(phases: list[tuple], dry: bool) -> dict[int, float]:
    """The same model and step on batches already on the device, per phase size and per-GPU batch."""
    from bench import gpu_throughput

    out = {}
    for res, b, _m in phases:
        argv = ["--variants", "lightray_compile", "--arch", "resnet50", "--res", str(res), "--batch", str(b),
                "--warmup", "10", "--steps", "20", "--windows", "2", "--classes", "100"]
        if dry:
            argv = ["--variants", "lightray", "--cpu-dry-run", "--arch", "resnet_tiny"]  # the dry run's model
        with open(os.devnull, "w") as sink:
            stdout, sys.stdout = sys.stdout, sink  # its own JSON line is not this bench's line
            try:
                res_line = gpu_throughput.main(argv)
            finally:
                sys.stdout = stdout
        figs = res_line["figures"]
        out[res] = next(v for k, v in figs.items() if k.endswith("_img_s") and not k.startswith("plain"))
    return out


def build_parser() -> argparse.ArgumentParser:
    """The bench's command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--val-images", type=int, default=1000)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--raw-max", type=int, default=224,
                    help="tiers up to this size are stored decoded (device augmentation on a GPU); larger are JPEG")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU: the same entry points, no GPU")
    ap.add_argument("--keep", default="", help="folder for the data and the run (kept; reused source)")
    ap.add_argument("--phases", default=",".join(str(r) for r, _b, _m in PHASES),
                    help="which phases to run, by resolution (a dry run takes its tiny phases at the same places)")
    return ap


def _select_phases(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[tuple], tuple[int, int]]:
    """(the phases asked for by ``--phases``, the source images' size); a dry run takes its tiny phases and
    shrinks the data in ``args``."""
    dry = args.dry_run
    want = [int(r) for r in args.phases.split(",") if r.strip()]
    known = [r for r, _b, _m in PHASES]
    if not want or any(r not in known for r in want):
        ap.error(f"--phases: bad value {args.phases!r}; allowed: a comma list of {known}")
    # A subset keeps each phase's batch and crop scale: the suite's 128 px run is the full run's first phase.
    phases = [(DRY_PHASES if dry else PHASES)[known.index(r)] for r in want]
    # The dry run's images stay above its largest phase (64 px), so the native-size rule clips no phase.
    size = (96, 72) if dry else (500, 375)
    if dry:
        args.images, args.val_images, args.classes, args.raw_max = min(args.images, 96), 16, 4, 48
    return phases, size


def run_training(args: argparse.Namespace, work: pathlib.Path, phases: list[tuple], size: tuple[int, int],
                 gpus: int, figures: dict[str, Any]) -> tuple[list[dict], GpuSampler]:
    """Generate the JPEG source (unless there), then the whole run through app/run.py with the GPUs sampled;
    returns (its metrics records, the sampler). Exits with the run's errors when it fails."""
    src = work / "src"
    t0 = time.perf_counter()
    if not (src / "train").is_dir():
        make_jpegs(src, args.images, args.val_images, args.classes, size, max(1, os.cpu_count() or 1))
    figures["generate_s"] = round(time.perf_counter() - t0, 1)
    note(f"{args.images} JPEGs in {figures['generate_s']} s; training")
    shutil.rmtree(work / "runs", ignore_errors=True)
    t0 = time.perf_counter()
    with GpuSampler() as gpu:
        proc = subprocess.run(run_args(src, work, phases, gpus, args.dry_run, args.raw_max), cwd=REPO,
                              capture_output=True, text=True)
    figures["run_s"] = round(time.perf_counter() - t0, 1)
    if proc.returncode != 0:
        # Ray's start-up chatter buries the cause: keep the lines that name an error, then the tails.
        errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "rror" in ln][-20:]
        raise SystemExit(f"gpu_e2e: app/run.py failed ({proc.returncode}):\n" + "\n".join(errors)
                         + f"\n--- stdout tail:\n{proc.stdout[-1500:]}\n--- stderr tail:\n{proc.stderr[-1500:]}")
    records = [json.loads(s) for s in (work / "runs" / "e2e" / "metrics.jsonl").read_text().splitlines() if s]
    return records, gpu


def _phase_figure(i: int, p: dict[str, Any], syn: float | None, util: dict[str, Any], on_device: bool,
                  decode: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Phase ``i``'s figures: end to end against synthetic, data wait, GPU use, where it augmented and decoded,
    and what starved it."""
    e2e = p["e2e_img_s"]
    ratio = round(e2e / syn, 3) if e2e and syn else None
    return {
        "e2e_img_s": e2e, "synthetic_img_s": syn, "ratio": ratio, "data_wait_frac": p["data_wait_frac"],
        **util, "augment_on": "device" if on_device else "cpu",
        "decode_on": decode[i]["on"] if i in decode else "raw tier: nothing to decode",
        "decode_measured": {k: decode[i][k] for k in ("cpu_img_s_per_cpu", "device_img_s", "cpus_per_gpu")}
        if i in decode else None,
        "windows": p["windows"],
        "starved_by": starved_by(ratio, p["data_wait_frac"], util["gpu_util_pct"], on_device,
                                 decode.get(i, {}).get("on") == "device")}


def summarise(records: list[dict], phases: list[tuple], dry: bool, gpu: GpuSampler, figures: dict[str, Any],
              ratios: dict[str, Any]) -> None:
    """Per phase, the run's figures against the synthetic ceiling (measured here) into ``figures["phases"]`` and
    ``ratios``, then whether the goal was met."""
    device_phases = {r["phase"] for r in records if r.get("event") == "unit" and r.get("unit") == "augment_on"
                     and r.get("on") == "device" and "phase" in r}
    decode = decode_paths(records)
    for i, d in sorted(decode.items()):
        note(f"phase {i} ({phases[i][0]} px) decode: {d['on']} ({d['why']})")
    note("synthetic")
    synth = synthetic(phases, dry)
    per = phase_figures(records, phases)
    for i, (res, _b, _m) in enumerate(phases):
        p = per[res]
        util = gpu.between(p["t0"], p["t1"])
        figures["phases"][str(res)] = _phase_figure(i, p, synth.get(res), util, i in device_phases, decode)
        ratios[f"e2e_over_synthetic_{res}px"] = figures["phases"][str(res)]["ratio"]
    figures["goal"] = f"end-to-end >= {GOAL} x synthetic in every phase"
    figures["goal_met"] = all(ph["ratio"] is not None and ph["ratio"] >= GOAL for ph in figures["phases"].values())


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    machine = Machine()
    dry = args.dry_run
    phases, size = _select_phases(ap, args)
    import torch

    gpus = 0 if dry else torch.cuda.device_count()
    if not dry and gpus == 0:
        ap.error("no CUDA device visible; use --dry-run to check the script on CPU")
    work = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="lightray-gpu-e2e-"))
    figures: dict[str, Any] = {"phases": {}}
    ratios: dict[str, Any] = {}
    try:
        records, gpu = run_training(args, work, phases, size, gpus, figures)
        summarise(records, phases, dry, gpu, figures, ratios)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    emit("gpu_e2e", figures, ratios, machine.finish(argv, gpus=gpus, dry_run=dry, images=args.images,
                                                    classes=args.classes, raw_max_resolution=args.raw_max,
                                                    gpu=torch.cuda.get_device_name(0) if gpus else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
