"""Framework overhead: lightray's training path against a plain torch.distributed script, same work.

    python -m bench.overhead                   # 3 A/B pairs; 2 workers, resnet_tiny, 32 px, batch 128, 400 steps
    python -m bench.overhead --quick           # a correctness run in well under a minute of training
    python -m bench.overhead --resolution 64 --batch 64 --steps 120 --warmup 20

Both sides train the same model (``lightray.train.model.build_model``, resnet_tiny, same seed, channels_last
as in the demo recipe), on the same pre-decoded uint8 NHWC tensors (random pixels and labels made once
in this process; a pool of 50 global batches, cycled), with the same global batch, number of steps and
worker count. Steps/s are measured after the first ``--warmup`` steps on both sides, over the same range.

(a) plain: ``torch.multiprocessing`` spawns ``--workers`` processes, gloo process group (file store),
    ``DistributedDataParallel``, ``torch.optim.SGD`` (momentum 0.9, nesterov, the recipe's weight decay),
    cross-entropy with the recipe's label smoothing; each rank indexes its slice of every global batch
    straight out of an in-memory uint8 tensor and normalises it as lightray does. One torch thread per
    process (what torchrun sets, and what Ray gives a worker reserving under one CPU).

(b) lightray: the real ``lightray.train.worker.train_loop_per_worker`` run by a real Ray Train ``TorchTrainer``
    (``ScalingConfig`` with the recipe's ``cpus_per_worker``, ``RunConfig``/``FailureConfig``/
    ``CheckpointConfig`` as ``run_training`` builds them, Ray Data's resource cap as ``run_training`` sets
    it), so it includes: worker-group start, adaptive DDP bucket sizing, the comm hook (dense), the LR /
    momentum schedule applied every step, the run-log actor and TensorBoard events every
    ``--report-every`` steps, ``ray.train.get_preemption_info()`` (a collective) at every report, the
    end-of-epoch validation + checkpoint (after the timed range). The data path is a thin variant of
    ``lightray.data.ingest.PlanDataConfig``: the same per-rank streams (plan blocks -> ``map_batches`` tasks with
    the same fractional CPUs, per-rank task pool and ``preserve_order``) but each task slices the rank's
    rows out of the pre-decoded tensors (one object-store array) instead of decoding + cropping shard
    rows, so JPEG decode and augmentation are not measured; Ray Data streaming + Ray Train + the worker
    loop are. The run is not launched through ``run_training`` because that always prepares a shard cache
    from image files (decode + crop would then dominate); everything after preparation is reproduced.

Timing of (b) comes from the loop's own metrics (``elapsed_s`` at the reports of steps ``warmup`` and
``steps``, taken on rank 0 right after the optimizer step, as on the plain side).

Threads: both sides pin torch's intra-op threads to ``--threads`` (default 1) in every training process
(``bench.common.pin_threads``: ``torch.set_num_threads`` plus ``OMP_NUM_THREADS``/``MKL_NUM_THREADS``); the
lightray side does it in a thin wrapper around ``train_loop_per_worker``, and each side records the count
its ranks actually ran with (``figures.*_torch_threads``).

Pairs: ``--pairs`` (default 3) A/B pairs, interleaved and alternating in order (plain first in even pairs,
lightray first in odd ones) so that a load drift weighs on both sides alike. Each pair gives one ratio
lightray/plain steps/s; ``ratios.lightray_over_plain_steps_per_s`` is their median, with min, max and every
pair's value beside it. ``ratios.resolved`` is false when the pairs' spread (max - min) is wider than the gap
being measured (|median - 1|): the machine then cannot tell the two sides apart, and the figure must be
quoted as unresolved, not as a number.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from typing import Any, NoReturn

import numpy as np
import torch

from bench.common import (
    REPO,
    CpuSampler,
    Machine,
    emit,
    load_avg,
    note,
    pin_threads,
    ratio,
    read_jsonl,
    resolved_ratio,
)
from lightray.train.device import IMAGENET_MEAN, IMAGENET_STD

POOL_STEPS = 50  # distinct global batches held in memory; step s trains on batch s % POOL_STEPS


def make_data(steps: int, batch: int, resolution: int, classes: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``min(steps, POOL_STEPS) * batch`` random uint8 NHWC images and labels (the work is the same whatever
    the pixels; cycling a pool keeps long runs small in memory and in the object store)."""
    rng = np.random.default_rng(seed)
    n = min(steps, POOL_STEPS) * batch
    images = rng.integers(0, 256, size=(n, resolution, resolution, 3), dtype=np.uint8)
    labels = rng.integers(0, classes, size=n).astype(np.int64)
    return images, labels


def build_config(args: argparse.Namespace, storage: str, name: str):
    from lightray.config import load_config

    return load_config("demo", {
        "name": name, "storage": storage,
        "schedule.epochs": 1, "schedule.warmup_epochs": 0.0, "schedule.eval_resolution": args.resolution,
        "schedule.phases": [{"until_epoch": 1, "resolution": args.resolution, "batch_size": args.batch,
                             "min_scale": 1.0}],
        "scaling.workers": str(args.workers), "scaling.ray_address": "local",
        "data.demo_classes": args.classes, "report.every_steps": args.report_every,
        "checkpoint.keep": 1,
    })


# --- (a) plain torch.distributed ------------------------------------------------------------------
def _plain_worker(rank: int, world: int, folder: str, images: np.ndarray, labels: np.ndarray, cfg_dict: dict,
                  steps: int, warmup: int, threads: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightray.config import config_from_dict
    from lightray.data.plan import rank_slice
    from lightray.train.device import autocast, precision_for
    from lightray.train.model import build_model

    pin_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    cfg = config_from_dict(cfg_dict)
    batch = cfg.schedule.phases[0].batch_size
    torch.manual_seed(cfg.scaling.seed)
    model = build_model(cfg.model, cfg.data.demo_classes)
    if cfg.model.channels_last:
        model = model.to(memory_format=torch.channels_last)
    ddp = DDP(model)
    lr = cfg.optim.lr_per_256 * batch / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.optim.momentum, nesterov=cfg.optim.nesterov,
                          weight_decay=cfg.optim.weight_decay)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=cfg.optim.label_smoothing)
    x_all, y_all = torch.from_numpy(images), torch.from_numpy(labels)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255
    lo, hi = rank_slice(batch, world, rank)
    cpu = torch.device("cpu")
    precision = precision_for(cfg.model, cpu)  # lightray's own choice for this CPU: like with like
    marks: dict[int, float] = {}
    losses = []
    for step in range(steps):
        base = (step % POOL_STEPS) * batch
        rows = slice(base + lo, base + hi)
        x = x_all[rows].permute(0, 3, 1, 2).float().sub_(mean).div_(std)
        if cfg.model.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with autocast(precision, cpu):
            loss = loss_fn(ddp(x), y_all[rows])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        marks[step + 1] = time.perf_counter()
    if rank == 0:
        pathlib.Path(folder, "result.json").write_text(json.dumps(
            {"t_warm": marks[warmup], "t_end": marks[steps], "first_loss": losses[0], "last_loss": losses[-1],
             "steps": len(losses), "threads": torch.get_num_threads()}))
    dist.barrier()
    dist.destroy_process_group()


def run_plain(images: np.ndarray, labels: np.ndarray, cfg_dict: dict, workers: int, steps: int,
              warmup: int, threads: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        t0 = time.perf_counter()
        mp.spawn(_plain_worker, args=(workers, folder, images, labels, cfg_dict, steps, warmup, threads),
                 nprocs=workers, join=True)
        wall = time.perf_counter() - t0
        res = json.loads(pathlib.Path(folder, "result.json").read_text())
    res["steps_per_s"] = (steps - warmup) / (res["t_end"] - res["t_warm"])
    res["wall_s"] = wall
    return res


# --- (b) lightray ---------------------------------------------------------------------------------
def _slice_blocks(blocks: dict, *, data: list, batch: int, rank: int, world_size: int) -> dict:
    """Rank's rows of the steps in ``blocks``: the in-memory stand-in for ``ingest.train_block_batch``."""
    import ray

    from lightray.data.plan import rank_slice

    images, labels = ray.get(data[0])  # zero-copy views of the object-store arrays
    lo, hi = rank_slice(batch, world_size, rank)
    idx = [(step % POOL_STEPS) * batch + i
           for epoch, step0, n in zip(blocks["epoch"].tolist(), blocks["step0"].tolist(), blocks["nsteps"].tolist())
           for step in range(step0, step0 + n) for i in range(lo, hi)]
    idx_a = np.asarray(idx, dtype=np.int64)
    return {"image": images[idx_a], "label": labels[idx_a], "sample_id": idx_a,
            "epoch": np.zeros(len(idx_a), dtype=np.int64)}


def _val_rows(blocks: dict, *, data: list, rank: int, world_size: int) -> dict:
    import ray

    images, labels = ray.get(data[0])
    idx = np.concatenate([np.arange(s + rank, e, world_size) for s, e in
                          zip(blocks["start"].tolist(), blocks["end"].tolist())]).astype(np.int64)
    return {"image": images[idx], "label": labels[idx], "sample_id": idx}


def _in_memory_data_config(spec, data_ref, val_ref, batch: int):
    """``PlanDataConfig`` with the map function swapped for a slice of the pre-decoded tensors."""
    from lightray.data.ingest import PlanDataConfig

    class InMemoryPlanDataConfig(PlanDataConfig):
        def map_for(self, name, rank, world_size):
            if name.startswith("train_p"):
                fn, kw = _slice_blocks, {"data": [data_ref], "batch": batch}
            else:
                fn, kw = _val_rows, {"data": [val_ref]}
            return fn, {**kw, "rank": rank, "world_size": world_size}

    return InMemoryPlanDataConfig(spec)


def _train_blocks(run_dir: str, spec):
    from lightray.data.ingest import make_blocks_dataset, phase_blocks
    from lightray.train.state import choose_and_record_resume

    choose_and_record_resume(run_dir)  # what runner._train_dataset does at each worker-group start
    return make_blocks_dataset(phase_blocks(spec, 0, 0, 0))


def _val_blocks(n: int):
    import ray.data

    return ray.data.from_items([{"start": 0, "end": n}], override_num_blocks=1)


def _pinned_train_loop(config: dict) -> None:
    """``train_loop_per_worker`` with torch's threads pinned first, as the plain side pins them; each rank
    records the count it ran with."""
    import ray.train

    from lightray.train.worker import train_loop_per_worker

    config = dict(config)
    threads, folder = config.pop("bench_threads"), config.pop("bench_threads_dir")
    used = pin_threads(threads)
    pathlib.Path(folder, f"threads-{ray.train.get_context().get_world_rank()}.txt").write_text(str(used))
    train_loop_per_worker(config)


def run_lightray(images: np.ndarray, labels: np.ndarray, cfg, steps: int, warmup: int, val_n: int,
                 threads: int) -> dict[str, Any]:
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from lightray import storage
    from lightray.data.ingest import IngestSpec, PhaseSpec, TierShards
    from lightray.driver.runner import _limit_data_resources, connect_ray
    from lightray.report.runlog import start_runlog

    t0 = time.perf_counter()
    connect_ray(cfg)
    ph = cfg.schedule.phases[0]
    empty = TierShards(ph.resolution, "raw", [], [], [])
    spec = IngestSpec(seed=cfg.scaling.seed, local_dir=tempfile.gettempdir(), train_size=steps * ph.batch_size,
                      phases=[PhaseSpec(0, ph.resolution, ph.batch_size, ph.min_scale, 0, 1, empty)], val=empty,
                      eval_resolution=ph.resolution, val_crop_ratio=cfg.data.val_crop_ratio,
                      prefetch_batches=cfg.data.prefetch_batches)
    data_ref = ray.put((images, labels))
    val_ref = ray.put((images[:val_n], labels[:val_n]))
    run_dir = storage.join(cfg.storage, cfg.name)
    os.makedirs(run_dir, exist_ok=True)
    workers = cfg.worker_range()[1]
    _limit_data_resources(cfg)
    runlog = start_runlog(cfg.name, run_dir, cfg.report.tensorboard)
    trainer = TorchTrainer(
        _pinned_train_loop,
        train_loop_config={"cfg": cfg.to_dict(), "spec": spec, "run_dir": run_dir,
                           "num_classes": cfg.data.demo_classes, "bench_threads": threads,
                           "bench_threads_dir": run_dir},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False,
                                     resources_per_worker={"CPU": cfg.scaling.cpus_per_worker}),
        run_config=RunConfig(name=cfg.name, storage_path=cfg.storage,
                             failure_config=FailureConfig(max_failures=0),
                             checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep)),
        datasets={"train_p0": partial(_train_blocks, run_dir, spec), "val": partial(_val_blocks, val_n)},
        dataset_config=_in_memory_data_config(spec, data_ref, val_ref, ph.batch_size),
    )
    # Which processes keep the cores busy during the timed steps: the two training workers, or Ray Data's tasks,
    # Ray's daemons and actors beside them (on 2 cores, every core-second they take is one the step waits for).
    with CpuSampler(os.getpid(), every_s=1.0) as sampler:
        trainer.fit()
    ray.get(runlog.flush.remote())
    wall = time.perf_counter() - t0
    lines = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    records = [r for r in lines if "event" not in r and "val_top1" not in r]
    at = {int(r["step"]): r for r in records}
    if warmup not in at or steps not in at:
        raise RuntimeError(f"lightray run {run_dir}: no metrics at steps {warmup} and {steps} (have {sorted(at)}); "
                           "--warmup and --steps must be multiples of --report-every")
    val = [r for r in lines if "val_top1" in r]
    dt = at[steps]["elapsed_s"] - at[warmup]["elapsed_s"]
    used = sorted({int(p.read_text()) for p in pathlib.Path(run_dir).glob("threads-*.txt")})
    return {"steps_per_s": (steps - warmup) / dt, "wall_s": wall, "steps": int(max(at)), "threads": used,
            "first_loss": records[0]["loss"], "last_loss": at[steps]["loss"],
            "data_wait_frac": statistics.mean(float(r["data_wait_frac"]) for r in records if r["step"] > warmup),
            "val_samples": val[-1].get("val_samples") if val else None,
            "cores_busy_by_kind": sampler.cores_by_kind(at[warmup]["time"], at[steps]["time"])}


def lightray_in_child(argv: list[str]) -> dict[str, Any]:
    """Run (b) in a child process in its own session. Seen here: after a Ray driver session (dashboard on)
    ended in this process, the process later exited with status 0 in the middle of the second plain run,
    printing nothing; keeping Ray out of the parent process avoids that."""
    out = subprocess.run([sys.executable, "-m", "bench.overhead", *argv, "--lightray-child"], cwd=REPO,
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"lightray side failed (exit status {out.returncode}); see its stderr above")
    return json.loads(lines[-1])


def build_parser() -> argparse.ArgumentParser:
    """The bench's command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=100, help="steps excluded from the timing on both sides")
    p.add_argument("--batch", type=int, default=128, help="global batch")
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--report-every", type=int, default=5, help="lightray's report.every_steps")
    p.add_argument("--pairs", type=int, default=3, help="interleaved A/B pairs (at least 3 to judge a spread)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per training process, on both sides")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that the bench works, not speed")
    p.add_argument("--lightray-child", action="store_true", help=argparse.SUPPRESS)
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Apply ``--quick``'s sizes, then reject inconsistent steps, warm-up, batch, pairs and threads."""
    if args.quick:
        args.steps, args.warmup, args.batch, args.report_every = 12, 4, 32, 4
    for key in ("steps", "warmup"):
        if getattr(args, key) % args.report_every:
            p.error(f"--{key}={getattr(args, key)}: expected a multiple of --report-every={args.report_every}")
    if not 0 < args.warmup < args.steps:
        p.error(f"--warmup={args.warmup}: expected 0 < warmup < --steps={args.steps}")
    if args.batch < args.workers:
        p.error(f"--batch={args.batch}: expected at least --workers={args.workers}")
    if args.pairs < 1 or args.threads < 1:
        p.error("--pairs and --threads: expected positive integers")


def _lightray_child(args: argparse.Namespace) -> NoReturn:
    """(b) alone, in the child process: its result as one JSON line for the parent, then exit at once."""
    images, labels = make_data(args.steps, args.batch, args.resolution, args.classes)
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as storage:
        cfg = build_config(args, storage, f"overhead-{int(time.time())}")
        light = run_lightray(images, labels, cfg, args.steps, args.warmup,
                             val_n=min(len(labels), 2 * args.batch), threads=args.threads)
    sys.stdout.write(json.dumps(light) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip Ray's own exit handlers: the result is out


@dataclasses.dataclass
class Pairs:
    """The A/B pairs' results: each side's runs, the order each pair ran in and the load at its start."""
    plains: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    lights: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    orders: list[str] = dataclasses.field(default_factory=list)
    loads: list[float] = dataclasses.field(default_factory=list)


def measure(args: argparse.Namespace, images: np.ndarray, labels: np.ndarray,
            child_argv: list[str]) -> tuple[Any, Pairs]:
    """Run ``--pairs`` interleaved A/B pairs, plain here and lightray in a child; returns (the config, the pairs)."""
    pairs = Pairs()
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as storage:
        cfg = build_config(args, storage, f"overhead-{int(time.time())}")
        for pair in range(args.pairs):
            # Alternate which side goes first: a load that rises or falls through the pair then favours each
            # side equally often instead of always the same one.
            order = ("plain", "lightray") if pair % 2 == 0 else ("lightray", "plain")
            pairs.orders.append("-".join(order))
            pairs.loads.append(load_avg())
            for side in order:
                note(f"pair {pair + 1}/{args.pairs}: {side} ({args.workers} workers, {args.threads} torch thread(s) "
                     f"each; load {load_avg()})")
                if side == "plain":
                    pairs.plains.append(run_plain(images, labels, cfg.to_dict(), args.workers, args.steps,
                                                  args.warmup, args.threads))
                else:
                    pairs.lights.append(lightray_in_child(child_argv))
            note(f"pair {pair + 1}: plain {pairs.plains[-1]['steps_per_s']:.2f}, lightray "
                 f"{pairs.lights[-1]['steps_per_s']:.2f} steps/s")
    return cfg, pairs


def summarise(args: argparse.Namespace, cfg: Any, pairs: Pairs) -> tuple[dict[str, Any], dict[str, Any]]:
    """(figures, ratios): each side's medians and runs, and lightray over plain per pair, judged on its spread."""
    plains, lights = pairs.plains, pairs.lights
    per_pair = [ratio(lt["steps_per_s"], pl["steps_per_s"]) for lt, pl in zip(lights, plains)]
    verdict = resolved_ratio(per_pair)
    plain_sps = statistics.median(r["steps_per_s"] for r in plains)
    light_sps = statistics.median(r["steps_per_s"] for r in lights)
    figures = {
        "workers": args.workers, "model": cfg.model.arch, "resolution": args.resolution, "global_batch": args.batch,
        "steps": args.steps, "warmup_steps_excluded": args.warmup, "pairs": args.pairs, "pair_orders": pairs.orders,
        "load_1m_at_pair_start": pairs.loads,
        "plain_steps_per_s": round(plain_sps, 3),
        "plain_steps_per_s_runs": [round(r["steps_per_s"], 3) for r in plains],
        "plain_images_per_s": round(plain_sps * args.batch, 1),
        "plain_wall_s_runs": [round(r["wall_s"], 1) for r in plains],
        "plain_steps_done": min(r["steps"] for r in plains),
        "plain_loss_first_last": [plains[0]["first_loss"], plains[0]["last_loss"]],
        "plain_torch_threads": sorted({r["threads"] for r in plains}),
        "lightray_steps_per_s": round(light_sps, 3),
        "lightray_steps_per_s_runs": [round(r["steps_per_s"], 3) for r in lights],
        "lightray_images_per_s": round(light_sps * args.batch, 1),
        "lightray_wall_s_runs": [round(r["wall_s"], 1) for r in lights],
        "lightray_steps_done": min(r["steps"] for r in lights),
        "lightray_loss_first_last": [lights[0]["first_loss"], lights[0]["last_loss"]],
        "lightray_torch_threads": sorted({t for r in lights for t in r["threads"]}),
        "lightray_data_wait_frac": round(statistics.median(r["data_wait_frac"] for r in lights), 4),
        "lightray_val_samples": lights[0]["val_samples"],
        # Measured (psutil, every second) over the timed steps of each lightray run: cores each kind of process
        # kept busy; the plain side has only its training processes.
        "lightray_cores_busy_by_kind_runs": [r.get("cores_busy_by_kind", {}) for r in lights],
    }
    ratios = {"lightray_over_plain_steps_per_s": verdict["median"],
              "lightray_over_plain_steps_per_s_min": verdict["min"],
              "lightray_over_plain_steps_per_s_max": verdict["max"],
              "lightray_over_plain_steps_per_s_pairs": verdict["runs"],
              "spread": verdict["spread"], "gap": verdict["gap"], "resolved": verdict["resolved"]}
    return figures, ratios


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    _check_args(p, args)
    if args.lightray_child:  # (b) alone, its result as one JSON line for the parent
        _lightray_child(args)
    machine = Machine()
    images, labels = make_data(args.steps, args.batch, args.resolution, args.classes)
    child_argv = argv if argv is not None else sys.argv[1:]
    cfg, pairs = measure(args, images, labels, child_argv)
    figures, ratios = summarise(args, cfg, pairs)
    emit("overhead", figures, ratios, machine.finish(quick=args.quick, threads=args.threads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
