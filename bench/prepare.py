"""Prepare throughput: lightray's shard builder vs a naive per-tier decode, side by side in one run.

Baseline (what a straightforward ImageFolder -> shards script does): for every tier, full-size
PIL decode of each source file, convert, resize short side, JPEG/raw encode, write one Parquet file.
lightray: one read + one draft-mode decode per image for the largest tier, smaller tiers resampled
from it; (a) in one thread (per-core gain), (b) the full prepare() as a Ray Data job (cluster gain).
Prints one JSON line. Run: python -m bench.prepare  [--images N]
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from bench.common import Machine, emit

TIERS = [64, 128, 224]
RAW_MAX = 64


def make_source(root: str, n: int, seed: int = 0) -> None:
    """ImageNet-like JPEGs: mostly ~500x375, one in eight a large camera original."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        cls = f"c{i % 4}"
        os.makedirs(f"{root}/train/{cls}", exist_ok=True)
        w, h = (1600, 1200) if i % 8 == 0 else (int(rng.integers(400, 520)), int(rng.integers(300, 400)))
        small = (rng.random((h // 16 + 1, w // 16 + 1, 3)) * 255).astype(np.uint8)
        img = Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC)  # smooth, photo-like spectrum
        img.save(f"{root}/train/{cls}/{i:05d}.jpg", quality=90)


def naive(root: str, out: str) -> int:
    from lightray.data.source import list_imagefolder

    entries = list_imagefolder(root).splits["train"]
    for t in TIERS:
        blobs = []
        for e in entries:
            with open(f"{root}/{e.path}", "rb") as f:
                img = Image.open(io.BytesIO(f.read())).convert("RGB")
            w, h = img.size
            s = t / min(w, h)
            img = img.resize((max(1, round(w * s)), max(1, round(h * s))), Image.Resampling.BICUBIC)
            if t <= RAW_MAX:
                blobs.append(img.tobytes())
            else:
                buf = io.BytesIO()
                img.save(buf, format="JPEG", quality=90)
                blobs.append(buf.getvalue())
        pq.write_table(pa.table({"image": pa.array(blobs, pa.binary())}), f"{out}/naive-{t}.parquet")
    return len(entries)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=96)
    args = ap.parse_args()
    machine = Machine()
    import ray

    from lightray.data import prepare as prep
    from lightray.data.source import list_imagefolder

    with tempfile.TemporaryDirectory() as tmp:
        src = f"{tmp}/src"
        make_source(src, args.images)
        os.makedirs(f"{tmp}/naive")
        t0 = time.perf_counter()
        n = naive(src, f"{tmp}/naive")
        naive_s = time.perf_counter() - t0

        listing = list_imagefolder(src)
        unit = {"split": "train", "index": 0, "source": listing.root, "out_dir": f"{tmp}/single", "tiers": TIERS,
                "formats": {str(t): prep.tier_format(t, RAW_MAX) for t in TIERS}, "jpeg_quality": 90,
                "io_threads": 1,
                "entries": [[i, e.path, e.size, e.label] for i, e in enumerate(listing.splits["train"])]}
        os.makedirs(f"{tmp}/single/{prep.PROGRESS_DIR}")
        t0 = time.perf_counter()
        prep.build_shard(unit)
        single_s = time.perf_counter() - t0

        cpus = os.cpu_count() or 1
        ray.init(address="local", num_cpus=cpus * 2, include_dashboard=False, log_to_driver=False)
        try:
            t0 = time.perf_counter()
            prep.prepare(src, f"{tmp}/cache", TIERS, raw_max_resolution=RAW_MAX, shard_rows=max(1, n // (cpus * 4)))
            ray_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            prep.prepare(src, f"{tmp}/cache", TIERS, raw_max_resolution=RAW_MAX, shard_rows=max(1, n // (cpus * 4)))
            noop_s = time.perf_counter() - t0
        finally:
            ray.shutdown()

    figures = {"images": n, "tiers": TIERS, "naive_images_per_s": round(n / naive_s, 1),
               "lightray_one_thread_images_per_s": round(n / single_s, 1),
               "lightray_prepare_images_per_s": round(n / ray_s, 1), "noop_rerun_s": round(noop_s, 4)}
    ratios = {"per_core_throughput_over_naive": round(naive_s / single_s, 2),
              "prepare_throughput_over_naive_serial": round(naive_s / ray_s, 2)}
    emit("prepare", figures, ratios, machine.finish(pillow=Image.__version__, pyarrow=pa.__version__))


if __name__ == "__main__":
    main()
