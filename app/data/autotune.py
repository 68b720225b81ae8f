"""Autotuned preprocessing: a few seconds of calibration at start choose how much preprocessing runs at once.

Tencent's 2020 record tuned its preprocessing threads per machine instead of guessing; here the knobs are
Ray Data's: tasks in flight (``map_concurrency``, all ranks together), CPUs each task reserves
(``map_cpus``) and global rows per task (``block_rows``). The calibration runs the real map work (shard
read or object-store get, decode, random-resized-crop, flip) of the most expensive phase as plain Ray
tasks, at 1, 2, 4, ... tasks in flight up to twice the CPUs left to Data after the Train workers'
reservation, and measures delivered images/s at each. It picks the *smallest* concurrency within 10% of
the best rate: more tasks than that add nothing but take cores from the training processes (and memory).
Rows per task follow from the measured per-image cost (about half a second of work per task: task
overhead stays small, batches still stream smoothly). Any of the three can be pinned in the config
(``data.preprocess_concurrency``, ``data.preprocess_cpus``, ``data.block_rows``); ``data.autotune_seconds=0``
turns the calibration off. The curve and the choice go to the run log as a ``preprocess_autotune`` unit
event.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from app.data import augment, autotune_cache
from app.data.plan import EpochPlan
from app.data.spec import BLOCK_ROWS, MAP_CPUS, IngestSpec
from app.data.timing import images_per_s

log = logging.getLogger(__name__)
MIN_CALIBRATION_SAMPLES = 2048  # below this a run is over before a calibration pays for itself
TASK_SECONDS = 0.5  # target work per map task
CALIBRATION_ROWS = 64  # rows per calibration task: short tasks give the measurement fine granularity
KEEP_FRACTION = 0.9  # the smallest concurrency reaching this share of the best rate wins


@dataclass
class Choice:
    concurrency: int | None
    cpus: float
    block_rows: int
    curve: list[dict] = field(default_factory=list)  # [{"concurrency": c, "images_per_s": r}, ...]
    reason: str = ""


def data_cpus(train_cpus: float) -> float:
    """Logical CPUs of the cluster left to Ray Data once the Train workers hold theirs."""
    return max(0.5, ray.cluster_resources().get("CPU", 1.0) - train_cpus)


def _calibration_task(spec: IngestSpec, phase: int, start: int, rows: int) -> int:
    """The map work for ``rows`` plan positions of epoch 0: what one ingest task does per image."""
    ph = spec.phases[phase]
    plan = EpochPlan(ph.shards.rows, spec.seed)
    order = plan.order(0)
    glob = order[start:start + rows] if start + rows <= len(order) else np.resize(order, rows)
    shard_idx, r = plan.to_shard_row(glob)
    n = 0
    if ph.device_decode:  # the device-decode path's task work: pass the bytes through, draw the crop
        for _data, h, w, _label, sid in ph.shards.encoded(spec.local_dir, shard_idx, r, spec.local_max_bytes):
            augment.draw_crop(augment.sample_rng(spec.seed, 0, sid), w, h, ph.min_scale)
            n += 1
        return n
    if ph.device_augment:  # the device path's task work, as the ingest's map does it: draw the crops, copy
        # every window onto the block's canvases
        found = list(ph.shards.arrays(spec.local_dir, shard_idx, r, spec.local_max_bytes))
        pixels = [px for px, _label, _sid in found]
        ids = np.asarray([sid for _px, _label, sid in found], np.int64)
        augment.device_windows(pixels, spec.seed, np.zeros(len(ids), np.int64), ids, ph.min_scale, ph.canvas)
        return len(pixels)
    for img, _label, sid in ph.shards.images(spec.local_dir, shard_idx, r, spec.local_max_bytes):
        augment.train_crop(img, ph.resolution, ph.min_scale, augment.sample_rng(spec.seed, 0, sid))
        n += 1
    return n


def measure(spec: IngestSpec, phase: int, concurrency: int, cpus: float, seconds: float,
            rows: int = CALIBRATION_ROWS, start: int = 0) -> float:
    """Delivered images/s with ``concurrency`` tasks of ``rows`` images kept in flight for ``seconds``
    (tasks still running at the deadline are waited for and counted, so no concurrency is favoured)."""
    from ray.data import DataContext

    # Placed the way Ray Data places the map tasks being sized (its scheduling strategy, not the caller's
    # placement group): a search trial's group has no bundle for a whole-core task, and capture into it
    # failed every unshared trial on data big enough to calibrate.
    task = ray.remote(num_cpus=cpus, max_retries=0,
                      scheduling_strategy=DataContext.get_current().scheduling_strategy)(_calibration_task)
    spec_ref = ray.put(spec)
    n_total = max(1, sum(spec.phases[phase].shards.rows))
    pos, done, pending = start, 0, []
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while True:
        while len(pending) < concurrency and time.perf_counter() < deadline:
            pending.append(task.remote(spec_ref, phase, pos % n_total, rows))
            pos += rows
        if not pending:
            break
        ready, pending = ray.wait(pending, num_returns=1)
        done += sum(ray.get(ready))
    return done / max(1e-9, time.perf_counter() - t0)


def calibrate(spec: IngestSpec, phase: int, avail_cpus: float, seconds: float,
              pinned_concurrency: int | None = None) -> Choice:
    """Measure the curve and choose (see the module docstring)."""
    top = max(1, math.ceil(2 * avail_cpus))
    candidates = [pinned_concurrency] if pinned_concurrency else sorted(
        {min(2**i, top) for i in range(0, int(math.log2(top)) + 2)})
    per_point = seconds / (len(candidates) + 1)
    # Warm-up at the largest concurrency: starts the worker processes and pays their imports untimed.
    measure(spec, phase, candidates[-1], min(1.0, avail_cpus / candidates[-1]), per_point / 2)
    curve = []
    for i, c in enumerate(candidates):
        rate = measure(spec, phase, c, min(1.0, avail_cpus / c), per_point, start=(i + 1) * 4096)
        curve.append({"concurrency": c, "images_per_s": round(rate, 1)})
    best = max(p["images_per_s"] for p in curve)
    chosen = next(p for p in curve if p["images_per_s"] >= KEEP_FRACTION * best)
    c = int(chosen["concurrency"])
    # Per-image seconds of one task: c tasks delivered ``rate`` images/s together.
    per_image = c / max(1e-9, chosen["images_per_s"])
    block_rows = int(2 ** round(math.log2(max(1.0, TASK_SECONDS / per_image))))
    block_rows = min(4096, max(64, block_rows))
    return Choice(c, round(min(1.0, avail_cpus / c), 3), block_rows, curve,
                  f"smallest concurrency within {KEEP_FRACTION:.0%} of the best {best:.0f} images/s")


def apply(spec: IngestSpec, *, concurrency: int = 0, cpus: float = 0.0, block_rows: int = 0, seconds: float = 4.0,
          train_cpus: float = 0.0, before_measure: Callable[[], Any] | None = None) -> Choice:
    """Set ``spec.map_concurrency``, ``spec.map_cpus`` and ``spec.block_rows``: pinned values (non-zero) as
    given, the rest calibrated (or defaults when the calibration is off or the data too small to time).
    ``before_measure`` is called before a real measurement (not for a cached or skipped one)."""
    avail = data_cpus(train_cpus)
    phase = max(range(len(spec.phases)), key=lambda i: spec.phases[i].resolution)
    ph = spec.phases[phase]
    if concurrency and cpus and block_rows:
        choice = Choice(concurrency, cpus, block_rows, reason="pinned by the config")
    elif seconds <= 0 or spec.train_size < MIN_CALIBRATION_SAMPLES:
        why = ("data.autotune_seconds=0" if seconds <= 0 else
               f"{spec.train_size} training samples < {MIN_CALIBRATION_SAMPLES}: too few to be worth timing")
        choice = Choice(concurrency or None, cpus or MAP_CPUS, block_rows or BLOCK_ROWS,
                        reason=f"calibration off ({why}); defaults for the values not pinned")
    else:
        t0 = time.perf_counter()
        key = autotune_cache.key_for(spec, phase, avail, seconds, concurrency or None)
        cached = autotune_cache.load(spec.local_dir, key)
        if cached is not None:
            choice = Choice(cached["concurrency"], cached["cpus"], cached["block_rows"], cached["curve"],
                            f"{cached['reason']}; cached from a calibration of the same data on this machine "
                            f"at {time.strftime('%Y-%m-%d %H:%M', time.localtime(cached['measured_at']))}")
        else:
            if before_measure is not None:
                before_measure()
            choice = calibrate(spec, phase, avail, seconds, concurrency or None)
            autotune_cache.save(spec.local_dir, key, {"concurrency": choice.concurrency, "cpus": choice.cpus,
                                                      "block_rows": choice.block_rows, "curve": choice.curve,
                                                      "reason": choice.reason})
        choice.concurrency = concurrency or choice.concurrency
        choice.cpus = cpus or choice.cpus
        choice.block_rows = block_rows or choice.block_rows
        choice.reason += f"; calibration took {time.perf_counter() - t0:.1f} s"
    spec.map_concurrency, spec.map_cpus, spec.block_rows = choice.concurrency, choice.cpus, choice.block_rows
    curve = ", ".join(f"{p['concurrency']}: {p['images_per_s']:.0f}" for p in choice.curve)
    spec.event("preprocess_autotune",
               f"preprocessing: {choice.concurrency or 'Ray Data default'} tasks in flight x {choice.cpus:g} CPU, "
               f"{choice.block_rows} rows per task ({choice.reason})"
               + (f"; measured on phase {phase} ({ph.resolution}px, {ph.shards.level}) images/s by tasks in "
                  f"flight {{{curve}}} with {avail:g} CPUs for data" if choice.curve else ""),
               concurrency=choice.concurrency, cpus=choice.cpus, block_rows=choice.block_rows, curve=choice.curve)
    return choice


# --- where JPEG tiers are decoded: CPU tasks or the workers' device ------------------------------------------
DECODE_SAMPLE = 64  # images timed per path: enough for a steady rate, a second or two of start-up
DEVICE_PROBE_TIMEOUT_S = 30.0  # a GPU task that cannot be placed (all GPUs held) gives up after this


@dataclass
class DecodeChoice:
    on: str  # "cpu" | "device"
    reason: str
    cpu_img_s_per_cpu: float | None = None  # the CPU path's per-image work (decode, crop, flip) in one process
    device_img_s: float | None = None  # batched decode_jpeg (+ the canvas paste) on the workers' device
    cpus_per_gpu: float | None = None


def sample_encoded(spec: IngestSpec, phase: int, n: int = DECODE_SAMPLE) -> list[tuple[bytes, int, int, int]]:
    """(JPEG bytes, height, width, sample id) of the first ``n`` plan positions of epoch 0 of ``phase``."""
    ph = spec.phases[phase]
    plan = EpochPlan(ph.shards.rows, spec.seed)
    shard_idx, rows = plan.to_shard_row(plan.order(0)[:n])
    return [(data, h, w, sid) for data, h, w, _label, sid in
            ph.shards.encoded(spec.local_dir, shard_idx, rows, spec.local_max_bytes)]


def cpu_decode_rate(sample: list[tuple[bytes, int, int, int]], resolution: int, min_scale: float, seed: int,
                    seconds: float = 1.0) -> float:
    """Images/s of the CPU path's per-image work (PIL decode, random-resized-crop, flip) in this one process:
    the rate one CPU gives when every Data task reserves one."""
    def once() -> None:
        for data, h, w, sid in sample:
            img = augment.decode(data, "jpeg", h, w)
            augment.train_crop(img, resolution, min_scale, augment.sample_rng(seed, 0, sid))

    return images_per_s(once, len(sample), seconds)


def _device_rate_task(encoded: list[bytes], seconds: float) -> float:
    import torch

    from app.data.device_decode import decode_rate

    return decode_rate(encoded, torch.device("cuda"), seconds)


def cuda_decode_rate(encoded: list[bytes], seconds: float = 1.0) -> tuple[float | None, str]:
    """(images/s of batched nvJPEG decode on a CUDA device, where it was timed), or (None, why not): in this
    process when it sees a GPU (a single-node run), else in a Ray task holding one GPU."""
    import torch

    if torch.cuda.is_available():
        return _device_rate_task(encoded, seconds), "cuda (driver process)"
    task = ray.remote(num_gpus=1, max_retries=0)(_device_rate_task)
    ref = task.remote(encoded, seconds)
    try:
        return float(ray.get(ref, timeout=DEVICE_PROBE_TIMEOUT_S)), "cuda (a one-GPU Ray task)"
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        return None, f"no GPU free for a probe within {DEVICE_PROBE_TIMEOUT_S:.0f} s"
    except ray.exceptions.RayError as exc:
        return None, f"the GPU probe failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"


def pick_decode(cpu_img_s_per_cpu: float, device_img_s: float, cpus_per_gpu: float) -> str:
    """``device`` when one GPU decodes faster than the CPUs each GPU has for data would, else ``cpu``."""
    return "device" if device_img_s > cpu_img_s_per_cpu * cpus_per_gpu else "cpu"


def choose_decode(spec: IngestSpec, phase: int, want: str, workers_use_cuda: bool, cpus_per_gpu: float,
                  seconds: float = 1.0, before_measure: Callable[[], Any] | None = None) -> DecodeChoice:
    """``data.decode_on`` for one JPEG phase. ``auto`` on CUDA workers times both paths on a sample of the tier
    and takes the device when one GPU's decode rate beats the CPU path's rate per CPU times the CPUs each GPU
    has for data; ``auto`` on CPU workers is the CPU (the "device" would be the same cores, minus Ray Data's
    parallelism); ``cpu`` / ``device`` force it (``device`` on CPU workers decodes on the CPU device in the
    Train worker: for tests and the bench)."""
    if want == "cpu":
        return DecodeChoice("cpu", "data.decode_on=cpu")
    if want == "device":
        return DecodeChoice("device", "data.decode_on=device" +
                            ("" if workers_use_cuda else "; the workers' device is the CPU: decode_jpeg on the CPU"))
    if not workers_use_cuda:
        return DecodeChoice("cpu", "data.decode_on=auto and the workers have no GPU: decoding in the worker "
                                   "would use the same CPUs as Ray Data tasks, without their parallelism")
    ph = spec.phases[phase]
    if before_measure is not None:
        before_measure()
    sample = sample_encoded(spec, phase)
    cpu = cpu_decode_rate(sample, ph.resolution, ph.min_scale, spec.seed, seconds)
    device, where = cuda_decode_rate([d for d, _, _, _ in sample], seconds)
    if device is None:
        return DecodeChoice("cpu", f"data.decode_on=auto: {where}; kept the CPU path", round(cpu, 1), None,
                            round(cpus_per_gpu, 2))
    cpu_total = cpu * cpus_per_gpu
    on = pick_decode(cpu, device, cpus_per_gpu)
    return DecodeChoice(on, f"data.decode_on=auto: decode_jpeg on {where} {device:.0f} img/s vs the CPU path "
                            f"{cpu:.0f} img/s per CPU x {cpus_per_gpu:.2g} CPUs per GPU for data = {cpu_total:.0f} "
                            f"img/s on {len(sample)} images of tier {ph.shards.tier}",
                        round(cpu, 1), round(device, 1), round(cpus_per_gpu, 2))
