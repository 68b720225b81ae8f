"""Prepare at growing sizes: does the per-file cost stay flat and the driver's memory grow sub-linearly?

For each size, an ImageFolder tree of small real JPEGs (a pool of distinct encoded images, written as
files spread over ``--classes`` folders) is prepared into a fresh cache on a local Ray cluster. Figures
per size: seconds per 1,000 files, driver peak RSS and PSS (sampled every 20 ms by a thread of the driver
process, as growth over the RSS just before prepare), manifest bytes and shard files. Side by side at the
smallest size: the same work (JPEG draft decode, resize to each tier, same raw/JPEG encoding, one Parquet
file per shard and tier) done by a plain ``multiprocessing.Pool`` of PIL workers with the same CPU count.
Both sides are timed warm: a first, untimed prepare of a tiny tree starts Ray Data's worker processes, and
the pool's processes are started before its clock.

Defaults fit a shared 2-core machine (2k, 8k, 32k files in 100 classes); ImageNet-like sizes are flags:
``python -m bench.prepare_scale --sizes 20000,80000,320000 --classes 1000``.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import tempfile
import threading
import time
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from bench.common import Machine, emit, load_avg, note, ratio

TIERS = [32, 64]
RAW_MAX = 32
SHARD_ROWS = 512


def jpeg_pool(n: int, seed: int = 0) -> list[bytes]:
    """``n`` distinct small JPEGs (80..160 px a side), photo-like smooth content."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        w, h = int(rng.integers(80, 160)), int(rng.integers(80, 160))
        small = (rng.random((h // 8 + 1, w // 8 + 1, 3)) * 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(small).resize((w, h), Image.Resampling.BILINEAR).save(buf, format="JPEG", quality=85)
        out.append(buf.getvalue())
    return out


def make_tree(root: str, files: int, classes: int, pool: list[bytes]) -> None:
    for c in range(classes):
        os.makedirs(f"{root}/train/c{c:04d}", exist_ok=True)
    for i in range(files):
        with open(f"{root}/train/c{i % classes:04d}/{i:07d}.jpg", "wb") as f:
            f.write(pool[i % len(pool)])


class PeakMemory:
    """Samples this process's RSS (and, less often, PSS) in a thread; peaks in MB."""

    def __init__(self, every_s: float = 0.02) -> None:
        self.proc = psutil.Process()
        self.every_s = every_s
        self.base_rss = self.proc.memory_info().rss
        self.peak_rss = self.base_rss
        self.peak_pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
            if i % 25 == 0:  # PSS walks smaps: too slow for every sample
                self.peak_pss = max(self.peak_pss, self.proc.memory_full_info().pss)
            i += 1
            self._stop.wait(self.every_s)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_pss = max(self.peak_pss, self.proc.memory_full_info().pss)


def _pool_shard(job: tuple[str, list[str], int]) -> int:
    """One shard the plain way: read, draft-decode, resize to each tier, encode, one Parquet file per tier."""
    out_dir, paths, index = job
    tiers = sorted(TIERS, reverse=True)
    cols: dict[int, list[bytes]] = {t: [] for t in tiers}
    for p in paths:
        with open(p, "rb") as f:
            img = Image.open(io.BytesIO(f.read()))
        w, h = img.size
        s = tiers[0] / min(w, h)
        img.draft("RGB", (round(w * s), round(h * s)))
        img = img.convert("RGB")
        for t in tiers:
            w, h = img.size
            s = t / min(w, h)
            img = img.resize((max(1, round(w * s)), max(1, round(h * s))), Image.Resampling.BICUBIC)
            if t <= RAW_MAX:
                cols[t].append(img.tobytes())
            else:
                buf = io.BytesIO()
                img.save(buf, format="JPEG", quality=90)
                cols[t].append(buf.getvalue())
    for t in tiers:
        pq.write_table(pa.table({"image": pa.array(cols[t], pa.binary())}), f"{out_dir}/pool-{t}-{index:05d}.parquet")
    return len(paths)


def pool_prepare(root: str, out_dir: str, cpus: int) -> float:
    """Seconds for the plain pool to do the same resize on every file of ``root``."""
    paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(f"{root}/train") for f in fs)
    os.makedirs(out_dir, exist_ok=True)
    jobs = [(out_dir, paths[i:i + SHARD_ROWS], j) for j, i in enumerate(range(0, len(paths), SHARD_ROWS))]
    with multiprocessing.get_context("spawn").Pool(cpus) as pool:
        # Timed warm, like lightray's side: every process started and its imports done before the clock.
        pool.map(_ready, range(4 * cpus), chunksize=1)
        t0 = time.perf_counter()
        done = sum(pool.imap_unordered(_pool_shard, jobs))
        seconds = time.perf_counter() - t0
    assert done == len(paths)
    return seconds


def _ready(_: int) -> int:
    time.sleep(0.05)  # long enough that one idle process does not take every call
    return os.getpid()


def measure_size(tmp: str, files: int, classes: int, pool: list[bytes]) -> dict[str, Any]:
    from lightray.data import prepare as prep

    src, cache = f"{tmp}/src-{files}", f"{tmp}/cache-{files}"
    make_tree(src, files, classes, pool)
    with PeakMemory() as mem:
        t0 = time.perf_counter()
        out = prep.prepare(src, cache, TIERS, raw_max_resolution=RAW_MAX, shard_rows=SHARD_ROWS)
        seconds = time.perf_counter() - t0
    shards = [f for f in os.listdir(out) if f.endswith(".parquet")]
    return {"files": files, "prepare_s": round(seconds, 2), "s_per_1k_files": round(1000 * seconds / files, 3),
            "images_per_s": round(files / seconds, 1),
            "driver_peak_rss_mb": round(mem.peak_rss / 2**20, 1),
            "driver_rss_growth_mb": round((mem.peak_rss - mem.base_rss) / 2**20, 1),
            "driver_peak_pss_mb": round(mem.peak_pss / 2**20, 1),
            "manifest_bytes": os.path.getsize(f"{out}/manifest.json"), "shard_files": len(shards)}


def start_ray(cpus: int, tries: int = 3) -> None:
    """A local Ray cluster. Ray gives its raylet a fixed 30 s to register: on a loaded machine (shared CI,
    other jobs) that can pass, and a fresh start usually makes it."""
    import ray

    for attempt in range(tries):
        try:
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
            return
        except Exception as exc:  # Ray raises a bare Exception for this timeout
            if "timed out during startup" not in str(exc) or attempt == tries - 1:
                raise
            note(f"Ray's node did not start in time ({exc}); retrying")
            ray.shutdown()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2000,8000,32000", help="comma-separated file counts")
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="Ray CPUs and pool processes")
    ap.add_argument("--workdir", default=None, help="where the trees and caches go (default: a temp folder)")
    args = ap.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    machine = Machine()
    import ray

    from lightray.data import prepare as prep

    pool = jpeg_pool(257)
    start_ray(args.cpus)
    try:
        with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
            # Not timed: the first prepare starts Ray Data's worker processes (each imports the prepare
            # code); timed in, it would inflate the smallest size's per-file cost and flatter the ratio.
            note("warm-up prepare (not timed)")
            warm = f"{tmp}/warm"
            make_tree(warm, 16 * args.cpus, 4, pool)
            prep.prepare(warm, f"{tmp}/warm-cache", TIERS, raw_max_resolution=RAW_MAX, shard_rows=8)
            per_size = []
            for n in sizes:
                note(f"prepare {n} files in {args.classes} classes")
                per_size.append(measure_size(tmp, n, args.classes, pool))
                note(f"{n} files: {json.dumps(per_size[-1])} (load {load_avg()})")  # kept if a later step dies
            ray.shutdown()  # the pool gets the CPUs to itself, as lightray had
            note(f"plain multiprocessing.Pool({args.cpus}) on the {sizes[0]} files")
            pool_s = pool_prepare(f"{tmp}/src-{sizes[0]}", f"{tmp}/pool", args.cpus)
    finally:
        ray.shutdown()
    small, large = per_size[0], per_size[-1]
    pool_ips = sizes[0] / pool_s
    figures = {"sizes": per_size, "classes": args.classes, "tiers": TIERS, "shard_rows": SHARD_ROWS,
               "cpus": args.cpus, "pool_images_per_s": round(pool_ips, 1),
               "lightray_images_per_s_per_core": round(small["images_per_s"] / args.cpus, 1),
               "pool_images_per_s_per_core": round(pool_ips / args.cpus, 1)}
    ratios = {"per_file_time_largest_over_smallest": ratio(large["s_per_1k_files"], small["s_per_1k_files"]),
              "driver_rss_growth_largest_over_smallest": ratio(max(large["driver_rss_growth_mb"], 1.0),
                                                               max(small["driver_rss_growth_mb"], 1.0)),
              "files_largest_over_smallest": ratio(sizes[-1], sizes[0]),
              "lightray_over_pool_prepare": ratio(small["images_per_s"], pool_ips)}
    return emit("prepare_scale", figures, ratios, machine.finish(argv, pillow=Image.__version__,
                                                                  pyarrow=pa.__version__))


if __name__ == "__main__":
    main()
