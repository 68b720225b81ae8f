"""Data pipeline throughput: images/s delivered to a consumer, lightray vs torchvision DataLoader baselines.

Side by side in one run, same source JPEGs (about 500x375, generated), same output sizes, same
augmentation (random-resized-crop with scale (0.35, 1) + horizontal flip, uint8 out), same CPU budget
(the machine's cores: DataLoader workers = cores, the resize pool = cores processes; Ray started with
num_cpus = cores):

(a1) ``dataloader_original``: torchvision ImageFolder + DataLoader(num_workers=cores), decode of the full
    original JPEG per image (the PyTorch ImageNet example's pipeline, with uint8 output instead of float, as
    lightray's).
(a2) ``dataloader_resized``: what a user who cares does (fast.ai did): a copy of the training images
    pre-resized once to each output size's short side (PIL draft mode, so libjpeg decodes at a reduced
    DCT scale, then the same bicubic resample lightray's tiers use; JPEG quality 90 as lightray's tiers),
    then the same ImageFolder + DataLoader over that copy. The resize time and its peak memory are
    reported (``resize_s``), like lightray's prepare.

Each DataLoader baseline runs ``--baseline-epochs`` passes (default 2; a new non-persistent loader each
pass, as the example does): the first (cold) pass, which pays the worker start and a first read of the
files, is reported apart (``*_cold_images_per_s``; for the resized copy the cold figure also pays the resize,
as lightray's cold figure pays its prepare), the later passes give the steady ``*_images_per_s``. The
files were just written, so "cold" here is not a cold page cache: this bench cannot drop the OS cache.
(b) ``cold``: lightray from the JPEG source: prepare (shard cache, every tier) + one ingest epoch that
    also copies each shard to an empty node-local directory. Figure = images / (prepare + epoch).
(c) ``shard``: lightray's Ray Data ingest from the node-local shard cache (the steady state).
(d) ``object``: the same from the object-store level (tier decoded once, materialize time reported).
(e) ``device``: device augmentation from the node-local shard cache of a raw tier (stored decoded): the tasks
    copy each sample's window and ship its crop box and flip bit; the figure is what reaches the consumer
    (pinned and copied to the GPU without blocking when there is one). The batched crop itself
    (``lightray.train.device.crop_resize_flip``) is timed apart on the bench's device, CUDA when present, else
    the CPU, and labelled so (``device_op_device``): on a GPU it costs the CPUs nothing.
(f) ``device_decode``: decode on the device from the node-local shard cache of the JPEG tier (the same shards
    as (c)): the tasks pass each sample's JPEG bytes through with its crop box and flip bit, and the consumer
    decodes each batch with ``torchvision.io.decode_jpeg`` (batched nvJPEG on CUDA) and crops it with the
    batched roi_align, as a Train worker does. The consumer's decode is inside the figure: without a GPU it
    runs on the CPU device, on the same cores as the tasks, and is labelled so (``device_decode_device``). The
    decode + crop alone is also timed apart on the bench's device (``device_decode_op_<size>px_images_per_s``).

Ratios are lightray over baseline images/s (bigger = lightray faster): ``{shard,object}_vs_dataloader_
{resized,original}_<size>px`` compare steady passes, ``cold_vs_dataloader_{resized,original}_cold_<size>px``
the first pass with its preparation. Peak memory is reported for every variant on both sides (``*_peak_mb``).

Per CPU core (``figures.per_core_img_s.<path>.<size>``, delivered images/s over the CPU budget): ``cpu_aug_shard``
(c), ``cpu_aug_object`` (d), ``device_aug`` (e) and ``device_decode`` (f); ``figures.cores_per_gpu.<path>``
divides a GPU's appetite (``--gpu-img-s``, default the synthetic ResNet-50 figure of ``bash bench/gpu_check.sh``
on one H200 at 224 px) by the per-core figure at ``--gpu-img-s-size``.

Each lightray figure is measured over ``--epochs`` whole epochs (default 4) through the real ingest (plan blocks
-> ``PlanDataConfig`` -> ``iter_batches``): epoch 0 runs as a pass of its own and is left out, as the DataLoader's
first pass is, and the steady figure is a second pass over the other epochs, its start-up included, with Ray
Data's tasks in flight, CPUs per task and
rows per task chosen as a run chooses them (``autotune.apply`` with ``--autotune-seconds``, default the
config's 4 s; the choice per variant is in ``*_autotune``; the cold figure pays the calibration).

Where the gap to the pre-resized DataLoader comes from: ``*_one_process_images_per_s`` is each side's work
per image on one core, in-process, without any inter-process machinery, and ``*_pipeline_efficiency`` is
what the whole pipeline delivers over cores x that figure; ``ratios.work_per_image_shard_vs_dataloader_
resized_<size>px`` times ``ratios.pipeline_efficiency_shard_vs_dataloader_resized_<size>px`` is the delivered
ratio. Ray Data's own account of each lightray variant's map operator is in ``*_ray_data`` (tasks, rows per task,
the tasks' mean wall time, how many ran at once on average, their CPU milliseconds per image): fewer tasks in
flight than the autotune chose is time Ray Data's scheduling loop left the cores idle between tasks.
Peak memory = the largest sum of the
proportional set size (PSS) of this process and all its descendants (DataLoader workers; Ray's raylet,
GCS and workers, object store pages included) seen while that variant ran.

Run: ``python -m bench.pipeline`` (``--quick`` for tiny sizes; ``--cpu-dry-run`` is accepted as an alias
used by bench/gpu_check.sh). Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from bench.common import Machine, emit, load_avg, note, tree_pss_mb

if TYPE_CHECKING:
    from lightray.data.manifest import Manifest

MIN_SCALE = 0.35
BATCH = 128
ONE_PROCESS_IMAGES = 1536  # images timed per side for the one-process (per-core work) figures
# Synthetic ResNet-50 training on one H200 (bf16, channels_last, compile, batch 256, 224 px), measured by
# bench/gpu_check.sh: what one GPU eats when the data is already on it.
GPU_IMG_S_H200_RN50_224 = 6319.0


def make_source(root: str | os.PathLike, n_train: int, n_val: int = 0, classes: int = 4, size: tuple = (500, 375),
                seed: int = 0) -> pathlib.Path:
    """An ImageFolder tree of smooth random JPEGs around ``size`` (w, h), +-20% and both orientations."""
    root = pathlib.Path(root)
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("val", n_val)):
        for i in range(n):
            cls = f"c{i % classes}"
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            w, h = (int(s * rng.uniform(0.8, 1.2)) for s in size)
            if i % 5 == 0:
                w, h = h, w  # some portrait images: rectangular validation has aspects to sort
            small = (rng.random((max(2, h // 16), max(2, w // 16), 3)) * 255).astype(np.uint8)
            Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC).save(
                root / split / cls / f"{i:05d}.jpg", quality=90)
    return root


class PeakMemory:
    """Polls the PSS of this process tree and keeps the peak, in MB."""

    def __init__(self, every_s: float = 0.2):
        self.every_s, self.peak, self._stop = every_s, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_pss_mb(os.getpid()))
            self._stop.wait(self.every_s)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_pss_mb(os.getpid()))


def _folder_dataset(root: pathlib.Path, size: int):
    """The baseline's dataset: ImageFolder over ``root``/train with the same augmentation as lightray's."""
    from torchvision import datasets, transforms

    tf = transforms.Compose([transforms.RandomResizedCrop(size, scale=(MIN_SCALE, 1.0)),
                             transforms.RandomHorizontalFlip(), transforms.PILToTensor()])
    return datasets.ImageFolder(str(root / "train"), transform=tf)


def _one_process_rate(batches: Iterator[int], images: int) -> float:
    """images/s over ``batches`` (each step yields how many images it handled), after one untimed step (the
    file cache, imports, a shard's local copy), until ``images`` have been timed."""
    next(batches)
    t0, n = time.perf_counter(), 0
    while n < images:
        n += next(batches)
    return n / (time.perf_counter() - t0)


def dataloader(root: pathlib.Path, size: int, workers: int, epochs: int, batch: int) -> dict[str, float | None]:
    """torchvision ImageFolder + DataLoader over ``root``/train: the first pass's and the later passes' images/s
    (``None`` with a single pass), the first pass's seconds, and the peak memory (MB) over all passes."""
    import torch

    ds = _folder_dataset(root, size)
    counts, secs = [], []
    with PeakMemory() as mem:
        for _ in range(epochs):
            t0, n = time.perf_counter(), 0
            loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                                                 drop_last=True)
            for x, _y in loader:
                n += len(x)
            counts.append(n)
            secs.append(time.perf_counter() - t0)
    warm = sum(counts[1:]) / sum(secs[1:]) if len(secs) > 1 else None
    return {"cold_img_s": counts[0] / secs[0], "cold_s": secs[0], "cold_images": counts[0], "warm_img_s": warm,
            "peak_mb": mem.peak}


def dataloader_one_process(root: pathlib.Path, size: int, batch: int, images: int = ONE_PROCESS_IMAGES) -> float:
    """images/s of the DataLoader's own work (decode, crop, flip, collate) in this process, no loader workers:
    its per-core cost, without any inter-process overhead."""
    import torch

    ds = _folder_dataset(root, size)
    loader = torch.utils.data.DataLoader(ds, batch_size=min(batch, len(ds)), shuffle=True, num_workers=0)
    # As many passes as it takes: a small set is read more than once.
    return _one_process_rate((len(x) for _ in itertools.count() for x, _y in loader), images)


def lightray_one_process(spec, images: int = ONE_PROCESS_IMAGES) -> float:
    """images/s of lightray's map function (read from the node-local shard cache, decode, crop, flip, stack)
    called in this process on the phase's plan blocks, without Ray: the per-core cost of the work its Ray
    Data tasks do."""
    from lightray.data.ingest import phase_blocks, train_block_batch

    def run(bl: dict) -> int:
        out = train_block_batch({k: np.array([bl[k]]) for k in ("epoch", "step0", "nsteps")},
                                spec=spec, phase=0, rank=0, world_size=1)
        return len(out["label"])

    # The plan's blocks in order, round again if the set is small.
    return _one_process_rate((run(bl) for bl in itertools.cycle(phase_blocks(spec, 0, 0, 0))), images)


def gap_breakdown(figures: dict, ratios: dict, sizes: list[int], cores: int) -> None:
    """Split lightray-vs-DataLoader (pre-resized) into the per-image work and the pipeline around it.

    ``*_one_process_images_per_s`` is each side's work per image on one core, without any inter-process
    machinery; ``*_pipeline_efficiency`` is what the full pipeline delivers over ``cores`` times that (1 = the
    cores do nothing but that work). The delivered ratio ``shard_vs_dataloader_resized`` is the product of the
    two ratios written here (per-image work, pipeline efficiency), so a gap reads as one, the other, or both."""
    for s in sizes:
        base = figures[f"dataloader_resized_{s}px_one_process_images_per_s"]
        ours = figures[f"shard_{s}px_one_process_images_per_s"]
        eff = {}
        for name, delivered, one in (("shard", figures[f"shard_{s}px_images_per_s"], ours),
                                     ("dataloader_resized", figures[f"dataloader_resized_{s}px_images_per_s"], base)):
            eff[name] = delivered / max(1e-9, cores * one)
            figures[f"{name}_{s}px_pipeline_efficiency"] = round(eff[name], 3)
        ratios[f"work_per_image_shard_vs_dataloader_resized_{s}px"] = round(ours / max(1e-9, base), 3)
        # From the unrounded efficiencies: at 0.013 against 0.024 the rounding alone moved this ratio by 4%.
        ratios[f"pipeline_efficiency_shard_vs_dataloader_resized_{s}px"] = round(
            eff["shard"] / max(1e-9, eff["dataloader_resized"]), 3)


def _resize_one(job: tuple[str, str, int]) -> None:
    """One image to short side ``short``: JPEG draft mode first (libjpeg's reduced-size IDCT, never below the
    target), then a bicubic resample to the exact size, saved as JPEG quality 90."""
    src, dst, short = job
    with Image.open(src) as img:
        w, h = img.size
        want = (short, max(1, round(h * short / w))) if w <= h else (max(1, round(w * short / h)), short)
        img.draft("RGB", want)
        out = img.convert("RGB")
        if out.size != want:
            out = out.resize(want, Image.Resampling.BICUBIC)
        out.save(dst, quality=90)


def resize_copy(src: pathlib.Path, dst: pathlib.Path, short: int, workers: int) -> tuple[float, float]:
    """Copy ``src``/train to ``dst``/train with every image's short side at ``short`` px, on ``workers``
    processes; (seconds, peak MB)."""
    jobs = []
    for path in sorted((src / "train").rglob("*.jpg")):
        out = dst / path.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        jobs.append((str(path), str(out), short))
    with PeakMemory() as mem:
        t0 = time.perf_counter()
        with ProcessPoolExecutor(max_workers=workers) as pool:
            list(pool.map(_resize_one, jobs, chunksize=max(1, len(jobs) // (4 * workers))))
        dt = time.perf_counter() - t0
    return dt, mem.peak


def baselines(src: pathlib.Path, work: pathlib.Path, sizes: list[int], cores: int, epochs: int,
              batch: int) -> dict[str, float]:
    """The two DataLoader baselines at every size: over the original JPEGs and over a pre-resized copy."""
    figures: dict[str, float] = {}
    for s in sizes:
        note(f"DataLoader over the original JPEGs, {s} px ({cores} workers, load {load_avg()})")
        orig = dataloader(src, s, cores, epochs, batch)
        key = f"dataloader_original_{s}px"
        figures[f"{key}_cold_images_per_s"] = round(orig["cold_img_s"], 1)
        figures[f"{key}_images_per_s"] = round(orig["warm_img_s"] or orig["cold_img_s"], 1)
        figures[f"{key}_peak_mb"] = round(orig["peak_mb"])
        resized = work / f"resized_{s}"
        shutil.rmtree(resized, ignore_errors=True)
        note(f"pre-resizing a copy to short side {s} px ({cores} processes, PIL draft mode)")
        resize_s, resize_peak = resize_copy(src, resized, s, cores)
        note(f"DataLoader over the pre-resized copy, {s} px")
        res = dataloader(resized, s, cores, epochs, batch)
        key = f"dataloader_resized_{s}px"
        figures[f"{key}_resize_s"] = round(resize_s, 2)
        figures[f"{key}_resize_peak_mb"] = round(resize_peak)
        figures[f"{key}_first_pass_images_per_s"] = round(res["cold_img_s"], 1)
        figures[f"{key}_cold_images_per_s"] = round(res["cold_images"] / (resize_s + res["cold_s"]), 1)
        figures[f"{key}_images_per_s"] = round(res["warm_img_s"] or res["cold_img_s"], 1)
        figures[f"{key}_peak_mb"] = round(max(res["peak_mb"], resize_peak))
        figures[f"{key}_one_process_images_per_s"] = round(dataloader_one_process(resized, s, batch), 1)
        shutil.rmtree(resized, ignore_errors=True)
    return figures


def _spec(manifest, size: int, local_dir: str, epochs: int, batch: int):
    """The one-phase ingest spec of ``size`` px, with Ray Data's knobs at their defaults until :func:`_tuned`."""
    from lightray.data.ingest import IngestSpec, PhaseSpec, tier_shards

    train = tier_shards(manifest, "train", size)
    n = manifest.num_samples("train")
    return IngestSpec(seed=0, local_dir=local_dir, train_size=n,
                      phases=[PhaseSpec(0, size, batch, MIN_SCALE, 0, epochs, train)],
                      val=tier_shards(manifest, "train", size), eval_resolution=size, val_crop_ratio=0.875)


def _tuned(spec, seconds: float, figures: dict, key: str) -> float:
    """Set the spec's tasks in flight, CPUs per task and rows per task as a run does (``autotune.apply``:
    calibrated on this machine, cached per data and level, defaults below its sample minimum); records the
    choice under ``figures[key + "_autotune"]`` and returns the seconds it took."""
    from lightray.data import autotune

    t0 = time.perf_counter()
    choice = autotune.apply(spec, seconds=seconds)
    dt = time.perf_counter() - t0
    figures[f"{key}_autotune"] = {"concurrency": choice.concurrency, "cpus": choice.cpus,
                                  "block_rows": choice.block_rows, "seconds": round(dt, 2)}
    return dt


def lightray_epochs(spec, to_device=None) -> tuple[float, float, float, dict]:
    """(images/s, seconds, peak MB, Ray Data's stats of the map operator) of the spec's single phase, as a worker
    consumes it; ``to_device(batch)`` is the consumer's copy (pinned, non-blocking), when there is a GPU to copy
    to. With two or more epochs, epoch 0 runs first as a pass of its own, left out as the DataLoader baselines
    leave their first pass out, and the figures are those of a second pass over the other epochs, start-up
    included (each DataLoader pass starts its workers too). One pass could not be cut at an epoch: Ray Data
    runs ahead of the consumer, so the later epochs would start with batches made before the cut."""
    from lightray.data.ingest import phase_blocks

    ph = spec.phases[0]
    blocks = phase_blocks(spec, 0, 0, 0)
    timed = [b for b in blocks if b["epoch"] > ph.first_epoch] or blocks
    with PeakMemory() as mem:
        if timed is not blocks:
            _consume(spec, [b for b in blocks if b["epoch"] == ph.first_epoch], to_device)
        t0 = time.perf_counter()
        n, it = _consume(spec, timed, to_device)
        dt = time.perf_counter() - t0
    return n / dt, dt, mem.peak, map_operator_stats(it, n)


def _consume(spec, blocks: list[dict], to_device=None):
    """(images, iterator) of one pass of the ingest over ``blocks``, as rank 0 of 1 consumes it."""
    from lightray.data.ingest import PlanDataConfig, make_blocks_dataset

    ds = make_blocks_dataset(blocks)
    it = PlanDataConfig(spec).configure({"train_p0": ds}, 1, None, None)[0]["train_p0"]
    n = 0
    for batch in it.iter_batches(batch_size=spec.phases[0].batch_size, batch_format="numpy", prefetch_batches=2):
        if to_device is not None:
            to_device(batch)
        n += len(batch["label"])
    return n, it


def map_operator_stats(it, images: int) -> dict:
    """Where Ray Data's map operator spent the run (its stats summary): tasks, rows per task, the tasks' mean
    wall time, how many ran at once on average (their summed wall time over the operator's) and their CPU time
    per image, which the one-process figure gives without Ray around it. Empty where this Ray has no summary."""
    dataset = getattr(it, "_base_dataset", None)  # DataIteratorImpl's dataset: the summary's only way in
    if dataset is None or not hasattr(dataset, "get_stats_summary"):
        return {}
    ops = [o for o in dataset.get_stats_summary().operators_stats if o.operator_name.startswith("MapBatches")]
    if not ops or ops[0].wall_time is None or ops[0].cpu_time is None:
        return {}
    op = ops[0]
    return {"tasks": op.wall_time.count, "rows_per_task": round(images / max(1, op.wall_time.count), 1),
            "task_wall_s_mean": round(op.wall_time.mean, 3),
            "tasks_in_flight_mean": round(op.wall_time.sum / max(1e-9, op.time_total_s), 2),
            "task_cpu_ms_per_image": round(1000 * op.cpu_time.sum / max(1, images), 3)}


def cuda_copy():
    """The consumer's copy to the GPU (pinned host memory, non-blocking), or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    from lightray.train.device import host_to_device

    device = torch.device("cuda")
    return lambda batch: [host_to_device(torch.from_numpy(batch[k]), device) for k in ("image", "box", "flip")]


def time_device_op(spec, size: int, batches: int = 3) -> tuple[float, str]:
    """(images/s, device) of the batched crop+resize+flip on one delivered batch, on CUDA when present."""
    import torch

    from lightray.data.ingest import phase_blocks, train_block_batch
    from lightray.train.device import crop_resize_flip

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    blocks = phase_blocks(spec, 0, 0, 0)[:1]
    b = train_block_batch({k: np.array([blk[k] for blk in blocks]) for k in ("epoch", "step0", "nsteps")},
                          spec=spec, phase=0, rank=0, world_size=1)
    x, box, flip = (torch.from_numpy(b[k]).to(device) for k in ("image", "box", "flip"))
    crop_resize_flip(x, box, flip, size)  # warm-up: kernel loads, allocator
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(batches):
        crop_resize_flip(x, box, flip, size)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return batches * len(x) / (time.perf_counter() - t0), device.type


def decode_consumer(size: int):
    """(the consumer of device-decode batches, its device): decode_jpeg + the batched crop on CUDA when
    present, else on the CPU device in this process, as a Train worker would."""
    import torch

    from lightray.data.device_decode import decode_batch
    from lightray.train.device import crop_resize_flip

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def consume(batch: dict) -> None:
        d = decode_batch(batch, device)
        crop_resize_flip(d.canvas, d.boxes, d.flips, size)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return consume, device.type


def time_decode_op(spec, size: int, batches: int = 3) -> float:
    """Images/s of decode_jpeg + the batched crop alone on one delivered batch (the consumer's work)."""
    from lightray.data.ingest import phase_blocks, train_block_batch

    blocks = phase_blocks(spec, 0, 0, 0)[:1]
    b = train_block_batch({k: np.array([blk[k] for blk in blocks]) for k in ("epoch", "step0", "nsteps")},
                          spec=spec, phase=0, rank=0, world_size=1)
    consume, _ = decode_consumer(size)
    consume(b)  # warm-up: nvJPEG handles, kernel loads, allocator
    t0 = time.perf_counter()
    for _ in range(batches):
        consume(b)
    return batches * len(b["label"]) / (time.perf_counter() - t0)


def per_core(figures: dict, sizes: list[int], cores: int, gpu_img_s: float, gpu_size: int) -> None:
    """Add ``per_core_img_s.<path>.<size>``, ``cores_per_gpu.<path>`` and the basis of the latter."""
    paths = {"cpu_aug_shard": "shard", "cpu_aug_object": "object", "device_aug": "device",
             "device_decode": "device_decode"}
    figures["per_core_img_s"] = {p: {str(s): round(figures[f"{v}_{s}px_images_per_s"] / cores, 1) for s in sizes}
                                 for p, v in paths.items()}
    basis = gpu_size if gpu_size in sizes else max(sizes)
    figures["cores_per_gpu"] = {p: round(gpu_img_s / max(1e-9, figures["per_core_img_s"][p][str(basis)]), 1)
                                for p in paths}
    figures["cores_per_gpu_basis"] = (f"{gpu_img_s:g} img/s per GPU (--gpu-img-s; default: synthetic ResNet-50, "
                                      f"bf16, channels_last, compile, one H200, bench/gpu_check.sh, at 224 px) over "
                                      f"the per-core figure at {basis} px")


def build_parser() -> argparse.ArgumentParser:
    """The bench's command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=3000, help="training images to generate")
    ap.add_argument("--sizes", default="128,224", help="output sizes, px")
    ap.add_argument("--epochs", type=int, default=None,
                    help="epochs per lightray variant, the first left out of the steady figure (default 4; 1 with "
                         "--quick, which then times its one epoch)")
    ap.add_argument("--baseline-epochs", type=int, default=2,
                    help="passes per DataLoader baseline: the first is reported as cold, the rest as steady")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a correctness run in well under a minute")
    ap.add_argument("--cpu-dry-run", action="store_true", help="alias of --quick (bench/gpu_check.sh)")
    ap.add_argument("--batch", type=int, default=BATCH, help="images per consumer batch")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="CPU budget (cores)")
    ap.add_argument("--autotune-seconds", type=float, default=4.0,
                    help="Ray Data knobs calibrated as a run does (data.autotune_seconds; 0: the defaults)")
    ap.add_argument("--keep", default="", help="folder to keep the generated data in (reused when present)")
    ap.add_argument("--gpu-img-s", type=float, default=GPU_IMG_S_H200_RN50_224,
                    help="a GPU's training appetite, img/s (default: synthetic ResNet-50 on one H200 at 224 px)")
    ap.add_argument("--gpu-img-s-size", type=int, default=224, help="the size the --gpu-img-s figure is at, px")
    return ap


def _start_ray(cores: int) -> None:
    """A local Ray cluster of exactly ``cores`` CPUs (one retry when start-up times out), progress bars off."""
    import ray

    # address="local": a cluster of exactly this CPU budget, never someone else's running one.
    try:
        ray.init(address="local", num_cpus=cores, include_dashboard=False, log_to_driver=False)
    except Exception as exc:  # "node timed out during startup" on an overloaded machine: one more try
        print(f"bench.pipeline: ray.init failed ({exc}); retrying once", file=sys.stderr)
        ray.shutdown()
        ray.init(address="local", num_cpus=cores, include_dashboard=False, log_to_driver=False)
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False


def _prepare_caches(src: pathlib.Path, work: pathlib.Path, sizes: list[int], cores: int,
                    figures: dict) -> tuple[Manifest, Manifest, Manifest, float]:
    """Prepare the shard caches the lightray variants read: (the default cache's manifest, an every-tier-raw
    one's for the device path, a JPEG one's for device decode, the default prepare's seconds); their seconds
    and the default prepare's peak memory go into ``figures``."""
    from lightray.data.manifest import Manifest
    from lightray.data.prepare import prepare

    cache = work / "cache"
    shutil.rmtree(work / "cache_raw", ignore_errors=True)
    shutil.rmtree(work / "cache_jpeg", ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(work / "local", ignore_errors=True)
    with PeakMemory() as mem:
        t0 = time.perf_counter()
        manifest = Manifest.load(str(prepare(str(src), str(cache), sizes, raw_max_resolution=64,
                                             shard_rows=256, num_cpus=1.0, concurrency=cores)))
        prepare_s = time.perf_counter() - t0
    figures["prepare_s"] = round(prepare_s, 2)
    figures["prepare_peak_mb"] = round(mem.peak)
    # The device path needs tiers stored decoded: a second cache of the same images with every tier raw.
    t0 = time.perf_counter()
    raw_manifest = Manifest.load(str(prepare(str(src), str(work / "cache_raw"), sizes,
                                             raw_max_resolution=max(sizes), shard_rows=256, num_cpus=1.0,
                                             concurrency=cores)))
    figures["prepare_raw_s"] = round(time.perf_counter() - t0, 2)
    # The device-decode path needs tiers stored as JPEG: sizes at or below the raw threshold get a third cache.
    jpeg_manifest = manifest
    if any(manifest.format("train", manifest.tier_for("train", s)) != "jpeg" for s in sizes):
        t0 = time.perf_counter()
        jpeg_manifest = Manifest.load(str(prepare(str(src), str(work / "cache_jpeg"), sizes, raw_max_resolution=0,
                                                  shard_rows=256, num_cpus=1.0, concurrency=cores)))
        figures["prepare_jpeg_s"] = round(time.perf_counter() - t0, 2)
    return manifest, raw_manifest, jpeg_manifest, prepare_s


def _cold_and_shard(manifest: Manifest, s: int, local: str, epochs: int, batch: int, tune_s: float, prepare_s: float,
                    figures: dict) -> None:
    """Variants (b) cold (prepare + calibration + one epoch copying each shard to an empty node-local
    directory) and (c) the node-local shard cache, at ``s`` px, into ``figures``."""
    n = manifest.num_samples("train")
    # (b) cold: prepare + calibration + one epoch that copies each shard to an empty node-local directory.
    spec = _spec(manifest, s, local, 1, batch)
    calib_s = _tuned(spec, tune_s, figures, f"cold_{s}px")
    _, dt, peak, _stats = lightray_epochs(spec)
    figures[f"cold_{s}px_images_per_s"] = round(n // batch * batch / (prepare_s + calib_s + dt), 1)
    figures[f"cold_{s}px_peak_mb"] = round(max(peak, figures["prepare_peak_mb"]))
    # (c) the node-local shard cache.
    spec = _spec(manifest, s, local, epochs, batch)
    _tuned(spec, tune_s, figures, f"shard_{s}px")
    rate, _, peak, stats = lightray_epochs(spec)
    figures[f"shard_{s}px_images_per_s"] = round(rate, 1)
    figures[f"shard_{s}px_ray_data"] = stats
    figures[f"shard_{s}px_peak_mb"] = round(peak)
    figures[f"shard_{s}px_one_process_images_per_s"] = round(lightray_one_process(spec), 1)


def _object_level(manifest: Manifest, s: int, local: str, epochs: int, batch: int, tune_s: float,
                  figures: dict) -> None:
    """Variant (d): the shards materialized at the object-store level, at ``s`` px, into ``figures``."""
    from lightray.data import shard_cache

    spec = _spec(manifest, s, local, epochs, batch)
    t0 = time.perf_counter()
    spec.phases[0].shards.refs = shard_cache.materialize(spec.phases[0].shards.uris,
                                                         spec.phases[0].shards.sha256,
                                                         spec.phases[0].shards.fmt, local, 1.0)
    figures[f"object_{s}px_materialize_s"] = round(time.perf_counter() - t0, 2)
    _tuned(spec, tune_s, figures, f"object_{s}px")
    rate, _, peak, stats = lightray_epochs(spec)
    figures[f"object_{s}px_images_per_s"] = round(rate, 1)
    figures[f"object_{s}px_ray_data"] = stats
    figures[f"object_{s}px_peak_mb"] = round(peak)


def _device_aug(raw_manifest: Manifest, s: int, local: str, epochs: int, batch: int, tune_s: float, figures: dict,
                ratios: dict) -> None:
    """Variant (e), device augmentation: a raw tier from the node-local shard cache, the crop left to the
    device, at ``s`` px; the crop alone is timed too."""
    import torch

    from lightray.data.ingest import plan_augmentation

    spec = _spec(raw_manifest, s, local, epochs, batch)
    plan_augmentation(spec, "device", torch.cuda.is_available())
    _tuned(spec, tune_s, figures, f"device_{s}px")
    rate, _, peak, stats = lightray_epochs(spec, cuda_copy())
    figures[f"device_{s}px_images_per_s"] = round(rate, 1)
    figures[f"device_{s}px_ray_data"] = stats
    figures[f"device_{s}px_peak_mb"] = round(peak)
    op_rate, figures["device_op_device"] = time_device_op(spec, s)
    figures[f"device_op_{s}px_images_per_s"] = round(op_rate, 1)
    ratios[f"device_aug_over_cpu_aug_{s}px"] = round(rate / max(1e-9, figures[f"shard_{s}px_images_per_s"]), 2)


def _device_decode(jpeg_manifest: Manifest, s: int, local: str, epochs: int, batch: int, tune_s: float, cores: int,
                   figures: dict, ratios: dict) -> None:
    """Variant (f), device decode: the JPEG tier's bytes passed through, decoded and cropped by the consumer,
    at ``s`` px; the consumer's decode + crop alone is timed too."""
    import torch

    from lightray.data.ingest import plan_decode

    spec = _spec(jpeg_manifest, s, local, epochs, batch)
    plan_decode(spec, "device", torch.cuda.is_available(), cpus_per_gpu=float(cores))
    _tuned(spec, tune_s, figures, f"device_decode_{s}px")
    consume, _ = decode_consumer(s)
    rate, _, peak, stats = lightray_epochs(spec, consume)
    figures[f"device_decode_{s}px_images_per_s"] = round(rate, 1)
    figures[f"device_decode_{s}px_ray_data"] = stats
    figures[f"device_decode_{s}px_peak_mb"] = round(peak)
    figures[f"device_decode_op_{s}px_images_per_s"] = round(time_decode_op(spec, s), 1)
    ratios[f"device_decode_over_cpu_aug_{s}px"] = round(
        rate / max(1e-9, figures[f"shard_{s}px_images_per_s"]), 2)


def _baseline_ratios(s: int, figures: dict, ratios: dict) -> None:
    """lightray over each DataLoader baseline at ``s`` px: steady passes (shard, object) and cold first passes."""
    for b in ("resized", "original"):
        base = f"dataloader_{b}_{s}px"
        for v in ("shard", "object"):
            ratios[f"{v}_vs_{base}"] = round(
                figures[f"{v}_{s}px_images_per_s"] / figures[f"{base}_images_per_s"], 2)
        ratios[f"cold_vs_dataloader_{b}_cold_{s}px"] = round(
            figures[f"cold_{s}px_images_per_s"] / figures[f"{base}_cold_images_per_s"], 2)


def _device_labels(figures: dict, cuda: bool) -> None:
    """Say where the device paths ran (the GPU, or the CPU device when there is none)."""
    figures["device_path_device"] = ("cuda: the crop runs on the GPU" if cuda else
                                     "cpu: no GPU here; the device path ran on the CPU device")
    figures["device_decode_device"] = (
        "cuda: batched nvJPEG decode + crop on the GPU" if cuda else
        "cpu: no GPU here; decode_jpeg + crop ran on the CPU device in the consumer, on the same cores as the "
        "Ray Data tasks")


def measure(args: argparse.Namespace, work: pathlib.Path, sizes: list[int], cores: int, batch: int,
            figures: dict, ratios: dict) -> None:
    """Every variant, baselines first, then lightray's after preparing its caches on a local Ray cluster;
    figures and ratios land in ``figures`` and ``ratios``."""
    import torch

    src = work / "src"
    if not (src / "train").is_dir() or sum(1 for _ in (src / "train").rglob("*.jpg")) != args.images:
        shutil.rmtree(src, ignore_errors=True)
        make_source(src, args.images)
    figures.update(baselines(src, work, sizes, cores, args.baseline_epochs, batch))
    _start_ray(cores)
    manifest, raw_manifest, jpeg_manifest, prepare_s = _prepare_caches(src, work, sizes, cores, figures)
    local, tune_s = str(work / "local"), args.autotune_seconds
    for s in sizes:
        _cold_and_shard(manifest, s, local, args.epochs, batch, tune_s, prepare_s, figures)
        _object_level(manifest, s, local, args.epochs, batch, tune_s, figures)
        _device_aug(raw_manifest, s, local, args.epochs, batch, tune_s, figures, ratios)
        _device_decode(jpeg_manifest, s, local, args.epochs, batch, tune_s, cores, figures, ratios)
        _baseline_ratios(s, figures, ratios)
    _device_labels(figures, torch.cuda.is_available())
    per_core(figures, sizes, cores, args.gpu_img_s, args.gpu_img_s_size)
    gap_breakdown(figures, ratios, sizes, cores)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    machine = Machine()
    if args.quick or args.cpu_dry_run:
        args.images, args.baseline_epochs = min(args.images, 400), 2
    args.epochs = args.epochs if args.epochs is not None else 1 if (args.quick or args.cpu_dry_run) else 4
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.baseline_epochs < 1 or args.epochs < 1:
        ap.error("--epochs and --baseline-epochs: expected positive integers")
    cores = max(1, args.workers)
    batch = max(1, min(args.batch, args.images))

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray

    work = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="lightray-bench-pipeline-"))
    figures: dict[str, float] = {}
    ratios: dict[str, float] = {}
    try:
        measure(args, work, sizes, cores, batch, figures, ratios)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    emit("pipeline", figures, ratios,
         machine.finish(argv, cores=cores, images=args.images, sizes=sizes, epochs=args.epochs,
                        baseline_epochs=args.baseline_epochs, batch=batch, gpu_img_s=args.gpu_img_s,
                        gpu_img_s_size=args.gpu_img_s_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
