"""Autotuned preprocessing: a few seconds of calibration at start choose how much preprocessing runs at once.

Tencent's 2020 record tuned its preprocessing threads per machine instead of guessing; here the knobs are
Ray Data's: tasks in flight (``map_concurrency``, all ranks together), CPUs each task reserves
(``map_cpus``) and global rows per plan block (``block_rows``). The calibration runs the real map work (shard
read or object-store get, decode, random-resized-crop, flip) of the most expensive phase as plain Ray
tasks, at 1, 2, 4, ... tasks in flight up to twice the CPUs left to Data after the Train workers'
reservation, and measures delivered images/s at each. It picks the *smallest* concurrency within 10% of
the best rate: more tasks than that add nothing but take cores from the training processes (and memory).
Rows per task follow from the measured per-image cost: about two seconds of work per task, so the time Ray
Data's scheduling loop takes to see a task end stays near a tenth of it (see :data:`TASK_SECONDS`), and at most
128 MiB of output; a plan block holds that many rows for each rank. Any of the three can be pinned in the config
(``data.preprocess_concurrency``, ``data.preprocess_cpus``, ``data.block_rows``); ``data.autotune_seconds=0``
turns the calibration off. The curve and the choice go to the run log as a ``preprocess_autotune`` unit
event.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil
import ray

from lightray.data import augment, autotune_cache, task_batches
from lightray.data.plan import EpochPlan
from lightray.data.spec import BLOCK_ROWS, MAP_CPUS, IngestSpec, PhaseSpec
from lightray.data.timing import images_per_s

log = logging.getLogger(__name__)
MIN_CALIBRATION_SAMPLES = 2048  # below this a run is over before a calibration pays for itself
# Rows per map task. Ray Data's scheduling loop polls its running tasks with a 0.1 s timeout (Ray 2.60) and a map
# task's end takes about two polls to be seen (its output, then its end of stream), so a task slot stays idle for
# a fraction of a second after each task; ``python -m bench.ray_data_gap`` measures it against plain Ray tasks, and
# ``python -m bench.pipeline`` reports the tasks in flight of each path (docs/BENCHMARKS.md). Two seconds of work
# per task keep that loss near a tenth. The calibration times plain Ray tasks, which do not see it.
TASK_SECONDS = 2.0
MAX_TASK_BYTES = 128 * 2**20  # Ray Data's target_max_block_size: a task's output past it is split into more blocks
MIN_TASK_ROWS, MAX_TASK_ROWS = 64, 4096
CALIBRATION_ROWS = 64  # rows per calibration task: short tasks give the measurement fine granularity
KEEP_FRACTION = 0.9  # the smallest concurrency reaching this share of the best rate wins


@dataclass
class Choice:
    concurrency: int | None
    cpus: float
    block_rows: int
    curve: list[dict] = field(default_factory=list)  # [{"concurrency": c, "images_per_s": r}, ...]
    reason: str = ""
    rows_per_task: int = 0  # calibrated: one task's rows (block_rows is this times the ranks); 0 = not calibrated


def data_cpus(train_cpus: float) -> float:
    """Units of the cluster's CPU resource left to Ray Data once the Train workers hold theirs (what Ray Data's
    tasks reserve; not cores: a local cluster offers twice the logical CPUs, see :func:`data_cores_per_gpu`)."""
    return max(0.5, ray.cluster_resources().get("CPU", 1.0) - train_cpus)


def _calibration_task(spec: IngestSpec, phase: int, start: int, rows: int) -> int:
    """The map work for ``rows`` plan positions of epoch 0: what one ingest task does per image
    (:func:`lightray.data.task_batches.positions_batch`, whichever path the phase takes)."""
    ph = spec.phases[phase]
    plan = EpochPlan(ph.shards.rows, spec.seed)
    order = plan.order(0)
    glob = order[start:start + rows] if start + rows <= len(order) else np.resize(order, rows)
    shard_idx, r = plan.to_shard_row(glob)
    batch = task_batches.positions_batch(spec, phase, np.zeros(len(r), np.int64), shard_idx, r)
    return len(batch["label"])


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
    rows = rows_per_task(per_image, output_bytes(spec.phases[phase]))
    return Choice(c, round(min(1.0, avail_cpus / c), 3), rows, curve,
                  f"smallest concurrency within {KEEP_FRACTION:.0%} of the best {best:.0f} images/s", rows)


def output_bytes(ph: PhaseSpec) -> int:
    """Bytes of one image a map task outputs on the phase's path (0 where it is a JPEG passed through)."""
    if ph.device_augment:
        return ph.canvas[0] * ph.canvas[1] * 3
    if ph.device_decode:
        return 0
    return ph.resolution * ph.resolution * 3


def rows_per_task(per_image_s: float, image_bytes: int = 0) -> int:
    """Rows one map task takes: about :data:`TASK_SECONDS` of work, at most :data:`MAX_TASK_BYTES` of output, a
    power of two within [MIN_TASK_ROWS, MAX_TASK_ROWS]."""
    rows = 2 ** round(math.log2(max(1.0, TASK_SECONDS / max(1e-9, per_image_s))))
    if image_bytes > 0:
        rows = min(rows, 2 ** math.floor(math.log2(max(1, MAX_TASK_BYTES // image_bytes))))
    return int(min(MAX_TASK_ROWS, max(MIN_TASK_ROWS, rows)))


def apply(spec: IngestSpec, *, concurrency: int = 0, cpus: float = 0.0, block_rows: int = 0, seconds: float = 4.0,
          train_cpus: float = 0.0, before_measure: Callable[[], Any] | None = None, ranks: int = 1) -> Choice:
    """Set ``spec.map_concurrency``, ``spec.map_cpus`` and ``spec.block_rows``: pinned values (non-zero) as
    given, the rest calibrated (or defaults when the calibration is off or the data too small to time).
    A plan block's rows are global: each of the ``ranks`` Train workers maps its share in its own task, so a
    calibrated block holds ``ranks`` times the rows one task should take.
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
            choice = Choice(cached["concurrency"], cached["cpus"], cached["rows_per_task"], cached["curve"],
                            f"{cached['reason']}; cached from a calibration of the same data on this machine "
                            f"at {time.strftime('%Y-%m-%d %H:%M', time.localtime(cached['measured_at']))}",
                            cached["rows_per_task"])
        else:
            if before_measure is not None:
                before_measure()
            choice = calibrate(spec, phase, avail, seconds, concurrency or None)
            autotune_cache.save(spec.local_dir, key, {"concurrency": choice.concurrency, "cpus": choice.cpus,
                                                      "rows_per_task": choice.rows_per_task, "curve": choice.curve,
                                                      "reason": choice.reason})
        choice.concurrency = concurrency or choice.concurrency
        choice.cpus = cpus or choice.cpus
        choice.block_rows = block_rows or choice.rows_per_task * max(1, ranks)
        choice.reason += (f"; {choice.rows_per_task} rows per task (about {TASK_SECONDS:g} s of work, at most "
                          f"{MAX_TASK_BYTES // 2**20} MiB out) x {max(1, ranks)} ranks; calibration took "
                          f"{time.perf_counter() - t0:.1f} s")
    spec.map_concurrency, spec.map_cpus, spec.block_rows = choice.concurrency, choice.cpus, choice.block_rows
    spec.map_concurrency_cpus = avail if choice.curve and not concurrency else None  # measured here, not pinned
    curve = ", ".join(f"{p['concurrency']}: {p['images_per_s']:.0f}" for p in choice.curve)
    spec.event("preprocess_autotune",
               f"preprocessing: {choice.concurrency or 'Ray Data default'} tasks in flight x {choice.cpus:g} CPU, "
               f"{choice.block_rows} rows per plan block ({choice.reason})"
               + (f"; measured on phase {phase} ({ph.resolution}px, {ph.shards.level}) images/s by tasks in "
                  f"flight {{{curve}}} with {avail:g} CPUs for data" if choice.curve else ""),
               concurrency=choice.concurrency, cpus=choice.cpus, block_rows=choice.block_rows, curve=choice.curve)
    return choice


# --- where JPEG tiers are decoded: CPU tasks or the workers' device ------------------------------------------
DECODE_SAMPLE = 64  # images timed per path: enough for a steady rate, a second or two of start-up
DEVICE_PROBE_TIMEOUT_S = 30.0  # a GPU task that cannot be placed (all GPUs held) gives up after this
NODE_PROBE_TIMEOUT_S = 10.0  # a node that does not report its cores in time is counted by this machine's ratio
# With the model's training rate unknown, the device wins only when the GPU decodes this many times what the
# CPUs feed: the golden ratio, where the worst case of either choice over every model rate loses the same share
# (see estimate_decode).
UNKNOWN_MODEL_RATIO = (1 + 5 ** 0.5) / 2


@dataclass
class DecodeChoice:
    on: str  # "cpu" | "device"
    reason: str
    cpu_img_s_per_cpu: float | None = None  # the CPU path's per-image work (decode, crop, flip) in one process
    device_img_s: float | None = None  # batched decode_jpeg (+ the canvas paste) on the workers' device
    cpus_per_gpu: float | None = None  # units of the cluster's CPU resource left to data per GPU
    cores_per_gpu: float | None = None  # the physical cores behind them
    model_img_s: float | None = None  # the model's training rate per GPU given as input (None: unknown)
    train_img_s: dict[str, float] | None = None  # the model's training img/s per GPU with each placement


@dataclass
class DecodeEstimate:
    """What each decode placement leaves the training rate of one GPU (see :func:`estimate_decode`)."""
    on: str
    cpu_feed_img_s: float  # images/s the CPUs each GPU has for data decode and crop
    break_even_img_s: float | None  # model training rate above which device decode wins; None: it never does
    train_img_s: dict[str, float] | None  # {"cpu": .., "device": ..} training img/s; None: model rate unknown
    rule: str  # the formula with its inputs, for the log


def estimate_decode(cpu_img_s_per_core: float, device_img_s: float, cores_per_gpu: float,
                    model_img_s: float = 0.0) -> DecodeEstimate:
    """The decode placement that leaves one GPU's training the higher rate, under a model.

    Device decode runs in the training process on its GPU, so each image's decode time adds to its step time:
    with T the model's training rate (img/s per GPU, decode elsewhere) and G the GPU's decode rate, training
    runs at 1/(1/T + 1/G). CPU decode costs the GPU nothing and feeds C = per-core rate x physical cores per
    GPU: training runs at min(T, C). Device decode wins iff G > C and T > C*G/(G - C) (the break-even rate).

    ``model_img_s`` <= 0 (unknown): device iff G > UNKNOWN_MODEL_RATIO * C. Choosing the CPU loses at worst the
    share 1 - C/G (a model of unbounded rate), choosing the device at worst C/(C + G) (a model of rate C, which
    the CPUs would have fed in full); the two are equal at G/C = the golden ratio."""
    c = cpu_img_s_per_core * cores_per_gpu
    g = device_img_s
    even = c * g / (g - c) if g > c else None
    if model_img_s > 0:
        t = model_img_s
        rates = {"cpu": min(t, c), "device": 1.0 / (1.0 / t + 1.0 / g)}
        on = "device" if rates["device"] > rates["cpu"] else "cpu"
        rule = (f"model: CPU decode trains at min(T, C) = min({t:.0f}, {cpu_img_s_per_core:.0f} x "
                f"{cores_per_gpu:.3g}) = {rates['cpu']:.0f} img/s per GPU; device decode adds each image's "
                f"decode to its step: 1/(1/T + 1/G) = 1/(1/{t:.0f} + 1/{g:.0f}) = {rates['device']:.0f} img/s "
                f"(T = data.decode_model_img_s)")
        return DecodeEstimate(on, c, even, {k: round(v, 1) for k, v in rates.items()}, rule)
    on = "device" if g > UNKNOWN_MODEL_RATIO * c else "cpu"
    rule = (f"model training rate T unknown (data.decode_model_img_s=0): device only when G = {g:.0f} img/s "
            f"exceeds {UNKNOWN_MODEL_RATIO:.3g} x the CPU feed C = {cpu_img_s_per_core:.0f} x {cores_per_gpu:.3g}"
            f" = {c:.0f} img/s (the choice whose worst case over any T loses the smaller share); "
            + (f"device decode would pay off for a model training faster than C*G/(G-C) = {even:.0f} img/s per GPU"
               if even is not None else "device decode cannot pay off: the CPUs feed as fast as the GPU decodes"))
    return DecodeEstimate(on, c, even, None, rule)


def pick_decode(cpu_img_s_per_core: float, device_img_s: float, cores_per_gpu: float,
                model_img_s: float = 0.0) -> str:
    """``device`` or ``cpu``, whichever gives the higher training rate (:func:`estimate_decode`)."""
    return estimate_decode(cpu_img_s_per_core, device_img_s, cores_per_gpu, model_img_s).on


def physical_cores() -> int:
    """Physical cores of this machine (its logical CPUs where the platform cannot tell)."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


# Zero CPUs: it must run on a node whose CPUs are all held, and it only reads a count.
_node_cores_task = ray.remote(num_cpus=0, max_retries=0)(physical_cores)


def node_cores(timeout_s: float = NODE_PROBE_TIMEOUT_S) -> list[tuple[float, int]]:
    """(units of Ray's CPU resource, physical cores) of each alive node that offers CPUs: this node counted here,
    each other node by a zero-CPU task pinned to it. A node that does not answer in ``timeout_s`` is counted
    with this machine's cores per logical CPU (Ray offers a node's logical CPUs unless told otherwise)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    nodes = [(n["NodeID"], float(n["Resources"].get("CPU", 0.0))) for n in ray.nodes()
             if n.get("Alive") and n.get("Resources", {}).get("CPU", 0.0) > 0]
    refs = {nid: _node_cores_task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False))
            .remote() for nid, _cpu in nodes if nid != here}
    ready, _late = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    local = physical_cores()
    out = []
    for nid, cpu in nodes:
        cores: float = local if nid == here else cpu * local / (os.cpu_count() or local)
        if nid in refs and refs[nid] in ready:
            try:
                cores = float(ray.get(refs[nid]))
            except ray.exceptions.RayError:
                pass  # keep the estimate
        out.append((cpu, int(max(1, round(cores)))))
    for ref in _late:
        ray.cancel(ref, force=True)
    return out


def data_cores_per_gpu(cpus_per_gpu: float, nodes: list[tuple[float, int]]) -> float:
    """The physical cores behind ``cpus_per_gpu`` units of the cluster's CPU resource, ``nodes`` as
    :func:`node_cores` gives them. lightray's local cluster offers twice the logical CPUs and a cloud vCPU is a
    hyperthread, so a unit is often a half or a quarter of a core; a node offering fewer CPUs than it has cores
    gives Ray's tasks at most one core per unit. Averaged over the cluster, as Ray Data spreads its tasks."""
    cpus = sum(cpu for cpu, _cores in nodes)
    cores = sum(min(cpu, float(n)) for cpu, n in nodes)
    return cpus_per_gpu * (cores / cpus if cpus > 0 else 1.0)


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
    the rate one core gives when every Data task has one."""
    ids = np.array([sid for _data, _h, _w, sid in sample], np.int64)
    heights = np.array([h for _data, h, _w, _sid in sample], np.int64)
    widths = np.array([w for _data, _h, w, _sid in sample], np.int64)

    def once() -> None:
        boxes, flips = augment.draw_crops(seed, np.zeros(len(ids), np.int64), ids, heights, widths, min_scale)
        for i, (data, h, w, _sid) in enumerate(sample):
            augment.train_crop(augment.decode(data, "jpeg", h, w), resolution, boxes[i], bool(flips[i]))

    return images_per_s(once, len(sample), seconds)


def _device_rate(encoded: list[bytes], seconds: float) -> float:
    import torch

    from lightray.data.device_decode import decode_rate

    return decode_rate(encoded, torch.device("cuda"), seconds)


# The nvJPEG probe runs in a one-GPU Ray task, never in the driver: a CUDA context made there would stay on
# GPU 0 (its memory and a share of its time) for the whole run. max_calls=1: the task's process exits after it,
# taking its context along (Ray's default for GPU tasks, stated because the driver relies on it).
device_probe = ray.remote(num_gpus=1, max_retries=0, max_calls=1)(_device_rate)


def cluster_gpus() -> float:
    return float(ray.cluster_resources().get("GPU", 0.0))


def cuda_decode_rate(encoded: list[bytes], seconds: float = 1.0) -> tuple[float | None, str]:
    """(images/s of batched nvJPEG decode on one GPU, where it was timed), or (None, why not): timed by
    :data:`device_probe` on a GPU node; not run at all when the cluster has no GPU."""
    if cluster_gpus() < 1:
        return None, "no GPU in the cluster (the nvJPEG probe was not run)"
    ref = device_probe.remote(encoded, seconds)
    try:
        return float(ray.get(ref, timeout=DEVICE_PROBE_TIMEOUT_S)), "one GPU (a one-GPU Ray task)"
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        return None, f"no GPU free for a probe within {DEVICE_PROBE_TIMEOUT_S:.0f} s"
    except ray.exceptions.RayError as exc:
        # The task's own error, not Ray's wrapper (whose first line is the task's name in colour codes).
        cause = getattr(exc, "cause", None) or exc
        first = (str(cause).strip().splitlines() or [""])[0][:200]
        return None, f"the GPU probe failed ({type(cause).__name__}: {first})"


def choose_decode(spec: IngestSpec, phase: int, want: str, workers_use_cuda: bool, cpus_per_gpu: float,
                  seconds: float = 1.0, before_measure: Callable[[], Any] | None = None,
                  model_img_s: float = 0.0) -> DecodeChoice:
    """``data.decode_on`` for one JPEG phase. ``auto`` on CUDA workers times the CPU path here (one core) and
    decode_jpeg on a GPU (:data:`device_probe`), counts the physical cores behind the ``cpus_per_gpu`` units of
    Ray's CPU resource each GPU has for data, and takes the placement that leaves training the higher rate
    (:func:`estimate_decode`; ``model_img_s`` the model's training rate per GPU, 0 = unknown). ``auto`` on CPU
    workers is the CPU (the "device" would be the same cores, minus Ray Data's parallelism); ``cpu`` /
    ``device`` force it (``device`` on CPU workers decodes on the CPU device in the Train worker: for tests and
    the bench)."""
    if want == "cpu":
        return DecodeChoice("cpu", "data.decode_on=cpu")
    if want == "device":
        return DecodeChoice("device", "data.decode_on=device" +
                            ("" if workers_use_cuda else "; the workers' device is the CPU: decode_jpeg on the CPU"))
    if not workers_use_cuda:
        return DecodeChoice("cpu", "data.decode_on=auto and the workers have no GPU: decoding in the worker "
                                   "would use the same CPUs as Ray Data tasks, without their parallelism")
    given = model_img_s if model_img_s > 0 else None
    ph = spec.phases[phase]
    if before_measure is not None:
        before_measure()
    sample = sample_encoded(spec, phase)
    # Timed even with no GPU up yet (a cluster that autoscales from a head alone): each worker-group start
    # decides again with it, once its rank 0 has timed decode_jpeg on its own GPU (app/data/start_decode.py).
    cpu = cpu_decode_rate(sample, ph.resolution, ph.min_scale, spec.seed, seconds)
    if cluster_gpus() < 1:
        return DecodeChoice("cpu", "data.decode_on=auto: no GPU in the cluster yet to time decode_jpeg on (the "
                                   "probe was not run); the CPU path until a worker-group start decides with the "
                                   "GPUs it got", round(cpu, 1), None, round(cpus_per_gpu, 2), None, given)
    device, where = cuda_decode_rate([d for d, _, _, _ in sample], seconds)
    cores = data_cores_per_gpu(cpus_per_gpu, node_cores())
    if device is None:
        return DecodeChoice("cpu", f"data.decode_on=auto: {where}; kept the CPU path", round(cpu, 1), None,
                            round(cpus_per_gpu, 2), round(cores, 2), given)
    est = estimate_decode(cpu, device, cores, model_img_s)
    reason = (f"data.decode_on=auto: {est.rule}; measured: decode_jpeg on {where} G = {device:.0f} img/s, the CPU "
              f"path {cpu:.0f} img/s per core in the driver, {cpus_per_gpu:.3g} of Ray's CPUs per GPU for data = "
              f"{cores:.3g} physical cores, on {len(sample)} images of tier {ph.shards.tier}")
    return DecodeChoice(est.on, reason, round(cpu, 1), round(device, 1), round(cpus_per_gpu, 2), round(cores, 2),
                        given, est.train_img_s)
