"""Data pipeline throughput: images/s delivered to a consumer, lightray vs the PyTorch ImageNet example.

Side by side in one run, same source JPEGs (about 500x375, generated), same output sizes, same
augmentation (random-resized-crop with scale (0.35, 1) + horizontal flip, uint8 out), same CPU budget
(the machine's cores: DataLoader workers = cores; Ray started with num_cpus = cores):

(a) ``baseline``: torchvision ImageFolder + DataLoader(num_workers=cores), decode of the full JPEG per
    image (the PyTorch ImageNet example's pipeline, with uint8 output instead of float, as lightray's).
(b) ``cold``: lightray from the JPEG source: prepare (shard cache, every tier) + one ingest epoch that
    also copies each shard to an empty node-local directory. Figure = images / (prepare + epoch).
(c) ``shard``: lightray's Ray Data ingest from the node-local shard cache (the steady state).
(d) ``object``: the same from the object-store level (tier decoded once, materialize time reported).

Each lightray figure is measured over ``--epochs`` whole epochs through the real ingest (plan blocks ->
``PlanDataConfig`` -> ``iter_batches``), start-up included. Peak memory = the largest sum of the
proportional set size (PSS) of this process and all its descendants (DataLoader workers; Ray's raylet,
GCS and workers, object store pages included) seen while that variant ran.

Run: ``python -m bench.pipeline`` (``--quick`` for tiny sizes; ``--cpu-dry-run`` is accepted as an alias
used by bench/gpu_check.sh). Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import time

import numpy as np
from PIL import Image

from bench.common import Machine, emit, tree_pss_mb

MIN_SCALE = 0.35
BATCH = 128


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


def baseline(root: pathlib.Path, size: int, workers: int, epochs: int, batch: int) -> tuple[float, float]:
    """(images/s, peak MB) of torchvision ImageFolder + DataLoader."""
    import torch
    from torchvision import datasets, transforms

    tf = transforms.Compose([transforms.RandomResizedCrop(size, scale=(MIN_SCALE, 1.0)),
                             transforms.RandomHorizontalFlip(), transforms.PILToTensor()])
    ds = datasets.ImageFolder(str(root / "train"), transform=tf)
    n = 0
    with PeakMemory() as mem:
        t0 = time.perf_counter()
        for _ in range(epochs):
            loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                                                 drop_last=True)
            for x, _y in loader:
                n += len(x)
        dt = time.perf_counter() - t0
    return n / dt, mem.peak


def _spec(manifest, size: int, local_dir: str, concurrency: int, epochs: int, batch: int):
    from app.data.ingest import IngestSpec, PhaseSpec, tier_shards

    train = tier_shards(manifest, "train", size)
    n = manifest.num_samples("train")
    return IngestSpec(seed=0, local_dir=local_dir, train_size=n,
                      phases=[PhaseSpec(0, size, batch, MIN_SCALE, 0, epochs, train)],
                      val=tier_shards(manifest, "train", size), eval_resolution=size, val_crop_ratio=0.875,
                      map_cpus=1.0, map_concurrency=concurrency, block_rows=batch)


def lightray_epochs(spec) -> tuple[float, float, float]:
    """(images/s, seconds, peak MB) over every epoch of the spec's single phase, as a worker consumes it."""
    from app.data.ingest import PlanDataConfig, make_blocks_dataset, phase_blocks

    n = 0
    with PeakMemory() as mem:
        t0 = time.perf_counter()
        ds = make_blocks_dataset(phase_blocks(spec, 0, 0, 0))
        it = PlanDataConfig(spec).configure({"train_p0": ds}, 1, None, None)[0]["train_p0"]
        for batch in it.iter_batches(batch_size=spec.phases[0].batch_size, batch_format="numpy", prefetch_batches=2):
            n += len(batch["label"])
        dt = time.perf_counter() - t0
    return n / dt, dt, mem.peak


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=3000, help="training images to generate")
    ap.add_argument("--sizes", default="64,128", help="output sizes, px")
    ap.add_argument("--epochs", type=int, default=2, help="epochs per lightray variant")
    ap.add_argument("--baseline-epochs", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a correctness run in well under a minute")
    ap.add_argument("--cpu-dry-run", action="store_true", help="alias of --quick (bench/gpu_check.sh)")
    ap.add_argument("--batch", type=int, default=BATCH, help="images per consumer batch")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="CPU budget (cores)")
    ap.add_argument("--keep", default="", help="folder to keep the generated data in (reused when present)")
    args = ap.parse_args(argv)
    machine = Machine()
    if args.quick or args.cpu_dry_run:
        args.images, args.epochs, args.baseline_epochs = min(args.images, 400), 1, 1
    sizes = [int(s) for s in args.sizes.split(",")]
    cores = max(1, args.workers)
    batch = max(1, min(args.batch, args.images))

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray

    from app.data import shard_cache
    from app.data.manifest import Manifest
    from app.data.prepare import prepare

    work = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="lightray-bench-pipeline-"))
    src = work / "src"
    figures: dict[str, float] = {}
    ratios: dict[str, float] = {}
    try:
        if not (src / "train").is_dir() or sum(1 for _ in (src / "train").rglob("*.jpg")) != args.images:
            shutil.rmtree(src, ignore_errors=True)
            make_source(src, args.images)
        for s in sizes:
            rate, peak = baseline(src, s, cores, args.baseline_epochs, batch)
            figures[f"baseline_{s}px_images_per_s"] = round(rate, 1)
            figures[f"baseline_{s}px_peak_mb"] = round(peak)

        # address="local": a cluster of exactly this CPU budget, never someone else's running one.
        try:
            ray.init(address="local", num_cpus=cores, include_dashboard=False, log_to_driver=False)
        except Exception as exc:  # "node timed out during startup" on an overloaded machine: one more try
            print(f"bench.pipeline: ray.init failed ({exc}); retrying once", file=sys.stderr)
            ray.shutdown()
            ray.init(address="local", num_cpus=cores, include_dashboard=False, log_to_driver=False)
        from ray.data import DataContext

        DataContext.get_current().enable_progress_bars = False
        cache, local = work / "cache", work / "local"
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)
        with PeakMemory() as mem:
            t0 = time.perf_counter()
            manifest = Manifest.load(str(prepare(str(src), str(cache), sizes, raw_max_resolution=64,
                                                 shard_rows=256, num_cpus=1.0, concurrency=cores)))
            prepare_s = time.perf_counter() - t0
        figures["prepare_s"] = round(prepare_s, 2)
        figures["prepare_peak_mb"] = round(mem.peak)
        n = manifest.num_samples("train")
        for s in sizes:
            # (b) cold: prepare + one epoch that copies each shard to an empty node-local directory.
            _, dt, peak = lightray_epochs(_spec(manifest, s, str(local), cores, 1, batch))
            figures[f"cold_{s}px_images_per_s"] = round(n // batch * batch / (prepare_s + dt), 1)
            figures[f"cold_{s}px_peak_mb"] = round(max(peak, figures["prepare_peak_mb"]))
            # (c) the node-local shard cache.
            rate, _, peak = lightray_epochs(_spec(manifest, s, str(local), cores, args.epochs, batch))
            figures[f"shard_{s}px_images_per_s"] = round(rate, 1)
            figures[f"shard_{s}px_peak_mb"] = round(peak)
            # (d) the object-store level.
            spec = _spec(manifest, s, str(local), cores, args.epochs, batch)
            t0 = time.perf_counter()
            spec.phases[0].shards.refs = shard_cache.materialize(spec.phases[0].shards.uris,
                                                                 spec.phases[0].shards.sha256,
                                                                 spec.phases[0].shards.fmt, str(local), 1.0)
            figures[f"object_{s}px_materialize_s"] = round(time.perf_counter() - t0, 2)
            rate, _, peak = lightray_epochs(spec)
            figures[f"object_{s}px_images_per_s"] = round(rate, 1)
            figures[f"object_{s}px_peak_mb"] = round(peak)
            del spec
            base = figures[f"baseline_{s}px_images_per_s"]
            for v in ("cold", "shard", "object"):
                ratios[f"{v}_over_baseline_{s}px"] = round(figures[f"{v}_{s}px_images_per_s"] / base, 2)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    emit("pipeline", figures, ratios,
         machine.finish(argv, cores=cores, images=args.images, sizes=sizes, epochs=args.epochs,
                        baseline_epochs=args.baseline_epochs, batch=batch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
