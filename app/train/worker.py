"""The per-worker training loop run by Ray Train's TorchTrainer.

One start of this function = one worker-group start. It resumes from the checkpoint chosen for this
start (``resume.json``), then walks the schedule phase by phase: each phase's data arrives as rank's
slice of every global batch from ``ray.train.get_dataset_shard("train_p<i>")``. Everything that
decides the next step (LR, resolution, batch) is computed from ``samples_seen``.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from typing import Any

import numpy as np
import ray.train
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from app.config import Config, config_from_dict
from app.data.ingest import IngestSpec
from app.data.plan import rank_slice
from app.report.runlog import get_runlog
from app.schedule import Schedule
from app.train import device as dev
from app.train import state as st
from app.train.comm import CommHook
from app.train.ema import ModelEMA
from app.train.evaluate import evaluate
from app.train.fusion import choose_bucket_mb
from app.train.model import build_model, to_device
from app.train.optim import build_loss, build_optimizer, clip_gradients, set_lr_momentum
from app.train.topology import topology_from_ray

log = logging.getLogger("lightray.worker")


class PreemptedError(RuntimeError):
    """Raised after the preemption checkpoint so that Ray Train restarts the group off the draining node."""


class _Reporter:
    """Sends metrics/events to the run log (rank 0 only) without blocking the step."""

    def __init__(self, run_name: str, rank: int):
        self.actor = get_runlog(run_name) if rank == 0 else None

    def __call__(self, record: dict[str, Any]) -> None:
        if self.actor is not None:
            try:
                self.actor.log.remote(record)
            except Exception:  # the driver (and its log) may be gone; training goes on
                self.actor = None


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def train_loop_per_worker(config: dict) -> None:
    cfg: Config = config_from_dict(config["cfg"])
    spec: IngestSpec = config["spec"]
    run_dir: str = config["run_dir"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    report = _Reporter(cfg.name, rank)
    t_start = time.time()

    device = dev.select_device()
    precision = dev.precision_for(cfg.model, device)
    dev.enable_cudnn_benchmark(cfg.model, device)
    torch.manual_seed(cfg.scaling.seed)  # same initial weights on every rank
    model = to_device(build_model(cfg.model, config["num_classes"]), device, cfg.model)
    topo = topology_from_ray()
    bucket_mb, evidence = choose_bucket_mb(model, world, device, pinned_mb=cfg.comm.bucket_mb)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=bucket_mb,
              gradient_as_bucket_view=True)
    comm = CommHook(cfg.comm, topo, device)
    comm.install(ddp)
    forward = dev.maybe_compile(ddp, cfg.model, device)
    optimizer = build_optimizer(model, cfg.optim, device)
    scaler = dev.make_grad_scaler(precision, device)
    ema = ModelEMA(model, cfg.optim.ema_decay) if cfg.optim.ema_decay > 0 else None
    loss_fn = build_loss(cfg.optim)
    sched = Schedule(cfg.schedule, cfg.optim, spec.train_size)

    # --- resume --------------------------------------------------------------------------------
    resume = st.read_recorded_resume(run_dir)
    counters = {"samples_seen": 0, "step": 0, "starts": 0, "device_seconds": 0.0, "train_seconds": 0.0,
                "resizes": 0, "preemption_checkpoints": 0, "world_size": world, "best_top1": 0.0}
    if resume.checkpoint:
        s0 = st.load_rank_state(resume.checkpoint, 0, device)
        model.load_state_dict(s0["model"])
        optimizer.load_state_dict(s0["optimizer"])
        if s0.get("scaler"):
            scaler.load_state_dict(s0["scaler"])
        if ema is not None and s0.get("ema"):
            ema.load_state_dict(s0["ema"])
        counters.update(s0["counters"])
        mine = st.load_rank_state(resume.checkpoint, rank, device) if rank < resume.world_size else None
        if mine is not None and "comm" in mine:
            comm.load_state_dict(mine["comm"], world_size=world)
        if mine is not None and resume.world_size == world:
            _set_rng_state(mine["rng"])
        if resume.world_size != world:
            counters["resizes"] += 1
            report({"event": "resize", "from": resume.world_size, "to": world,
                    "samples_seen": counters["samples_seen"]})
    if counters["samples_seen"] != resume.samples_seen:
        raise RuntimeError(f"checkpoint {resume.checkpoint} holds samples_seen={counters['samples_seen']} but the "
                           f"data stream was built for {resume.samples_seen}")
    counters["starts"] += 1
    counters["world_size"] = world
    report({"event": "start" if counters["starts"] == 1 else "restart", "samples_seen": counters["samples_seen"],
            "world_size": world, "checkpoint": resume.checkpoint, "skipped_checkpoints": resume.skipped,
            "total_samples": sched.total_samples, "ckpt_time": resume.time})
    for ev in dev.pop_unit_events() + [{"unit": "fusion", "message": f"DDP bucket {bucket_mb:.2f} MB",
                                         "evidence": evidence}, {"unit": "comm", "message": comm.describe()}] + \
            list(spec.events):  # data: which cache level serves each phase, preprocessing autotune, rect val
        report({"event": "unit", **ev})

    sample_log = None
    if cfg.report.log_samples and "://" not in run_dir:
        os.makedirs(os.path.join(run_dir, "sample_log"), exist_ok=True)
        # One file per rank and attempt; the attempt id (rank 0's clock) orders attempts that resumed from
        # the same checkpoint, so an audit can tell which replay the final model carries.
        attempt = torch.tensor([int(time.time() * 1000)], dtype=torch.int64, device=device)
        if dist.is_initialized():
            dist.broadcast(attempt, 0)
        sample_log = open(os.path.join(run_dir, "sample_log",
                                       f"start{counters['starts']}_attempt{int(attempt.item())}_rank{rank}.jsonl"), "a")

    # --- state capture ---------------------------------------------------------------------------
    def save(reason: str, metrics: dict) -> None:
        counters["device_seconds"] += (time.time() - clock[0]) * world
        counters["train_seconds"] += time.time() - clock[0]
        clock[0] = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            meta = {"samples_seen": counters["samples_seen"], "world_size": world, "reason": reason,
                    "time": time.time(), "step": counters["step"]}
            state = {"comm": comm.state_dict(), "rng": _rng_state()}
            if rank == 0:
                state.update(model=model.state_dict(), optimizer=optimizer.state_dict(), scaler=scaler.state_dict(),
                             ema=ema.state_dict() if ema is not None else None, counters=dict(counters),
                             config=cfg.to_dict())
            st.save_rank_state(tmp, rank, state, meta)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                             checkpoint_dir_name=st.checkpoint_name(counters["samples_seen"]))

    clock = [time.time()]
    notice_seen: list = [None]  # one preemption checkpoint per notice, not one per report interval
    last_ckpt_time = time.time()
    stop_at = cfg.checkpoint.stop_after_steps
    stopped = False
    every = cfg.report.every_steps
    if counters["samples_seen"] >= sched.total_samples:  # resumed a run that had already finished
        report({"event": "end", "samples_seen": counters["samples_seen"], "wall_s": 0.0})
        return
    pos = sched.locate(counters["samples_seen"])
    window = {"t": time.time(), "wait": 0.0, "n": 0, "loss": 0.0, "steps": 0}
    metrics: dict[str, Any] = {}
    resume_step = counters["step"]

    for phase_idx in range(pos.phase_index, len(cfg.schedule.phases)):
        phase = cfg.schedule.phases[phase_idx]
        ph_spec = spec.phases[phase_idx]
        lo, hi = rank_slice(phase.batch_size, world, rank)
        local_bs = hi - lo
        loss_scale = local_bs * world / phase.batch_size  # DDP averages: weight ranks by their share
        shard = ray.train.get_dataset_shard(f"train_p{phase_idx}")
        batches = iter(shard.iter_batches(batch_size=local_bs, batch_format="numpy",
                                          prefetch_batches=spec.prefetch_batches, drop_last=False))
        report({"event": "unit", "unit": "progressive_resize",
                "message": f"phase {phase_idx}: {phase.resolution}px, global batch {phase.batch_size}, "
                           f"min crop scale {phase.min_scale}", "phase": phase_idx})
        for epoch in range(max(ph_spec.first_epoch, pos.epoch), ph_spec.end_epoch):
            model.train()
            first_step = pos.step_in_epoch if epoch == pos.epoch else 0
            for step in range(first_step, sched.steps_in_epoch(epoch)):
                t0 = time.time()
                batch = next(batches)
                window["wait"] += time.time() - t0
                if batch["epoch"][0] != epoch:
                    raise RuntimeError(f"data stream out of step: got epoch {batch['epoch'][0]}, expected {epoch}")
                lr = sched.lr_at(counters["samples_seen"])
                mom = sched.momentum_at(counters["samples_seen"])
                set_lr_momentum(optimizer, lr, mom)
                x = dev.images_to_device(torch.from_numpy(batch["image"]), device, cfg.model.channels_last)
                y = torch.from_numpy(batch["label"]).to(device, non_blocking=True)
                with dev.autocast(precision, device):
                    loss = loss_fn(forward(x), y)
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss * loss_scale).backward()  # the scaler is a pass-through unless fp16
                clip_gradients(model, optimizer, cfg.optim, scaler)
                scaler.step(optimizer)
                scaler.update()
                if ema is not None:
                    ema.update(model)
                counters["samples_seen"] += phase.batch_size
                counters["step"] += 1
                if counters["step"] == resume_step + 1:  # start-up ends here
                    report({"event": "first_step", "step": counters["step"], "time": time.time(),
                            "data_wait_s": window["wait"]})
                if sample_log is not None:
                    sample_log.write(json.dumps({"samples_seen": counters["samples_seen"], "epoch": epoch,
                                                 "ids": batch["sample_id"].tolist()}) + "\n")
                    sample_log.flush()
                window["n"] += phase.batch_size
                window["steps"] += 1
                window["loss"] += float(loss.detach())
                if counters["step"] % every == 0:
                    dt = time.time() - window["t"]
                    metrics = {"step": counters["step"], "samples_seen": counters["samples_seen"], "epoch": epoch,
                               "epoch_progress": sched.locate(counters["samples_seen"]).epoch_progress
                               if counters["samples_seen"] < sched.total_samples else float(sched.epochs),
                               "phase": phase_idx, "resolution": phase.resolution, "batch_size": phase.batch_size,
                               "lr": lr, "momentum": mom, "loss": window["loss"] / window["steps"],
                               "images_per_s": window["n"] / max(dt, 1e-9),
                               "data_wait_frac": window["wait"] / max(dt, 1e-9), "comm_bytes": comm.bytes_sent,
                               "comm_mode": cfg.comm.mode, "restarts": counters["starts"] - 1,
                               "resizes": counters["resizes"], "world_size": world,
                               "device_seconds": counters["device_seconds"] + (time.time() - clock[0]) * world,
                               "elapsed_s": counters["train_seconds"] + time.time() - clock[0],
                               "total_samples": sched.total_samples}
                    report(metrics)
                    window = {"t": time.time(), "wait": 0.0, "n": 0, "loss": 0.0, "steps": 0}
                    # A drained node (spot notice) is known to every rank at once: all save the same step.
                    notice = ray.train.get_preemption_info()
                    if notice is not None and notice_seen[0] is None:
                        notice_seen[0] = notice
                        counters["preemption_checkpoints"] += 1
                        report({"event": "preemption_checkpoint", "samples_seen": counters["samples_seen"],
                                "notice": str(notice)})
                        save("preemption", dict(metrics))
                        # Leave now rather than train on until the deadline: steps after this checkpoint
                        # would be rolled back anyway, and the new worker group avoids the draining node.
                        raise PreemptedError(f"node preemption notice {notice}; checkpoint written at "
                                             f"samples_seen={counters['samples_seen']}, restarting")
                last_in_epoch = step == sched.steps_in_epoch(epoch) - 1
                by_steps = cfg.checkpoint.every_steps and counters["step"] % cfg.checkpoint.every_steps == 0
                by_time = (cfg.checkpoint.every_minutes
                           and time.time() - last_ckpt_time > 60 * cfg.checkpoint.every_minutes)
                stopped = bool(stop_at and counters["step"] == stop_at)
                if (by_steps or by_time or stopped) and not last_in_epoch:
                    save("interval", dict(metrics, samples_seen=counters["samples_seen"], step=counters["step"]))
                    last_ckpt_time = time.time()
                if stopped:
                    break
            if stopped and step != sched.steps_in_epoch(epoch) - 1:
                break  # stopped mid-epoch: the interval checkpoint above holds the position
            # --- end of epoch: validate, checkpoint -------------------------------------------------
            val = evaluate(ema.module if ema is not None else model, ray.train.get_dataset_shard("val"), device,
                           precision, cfg, spec.prefetch_batches)
            counters["best_top1"] = max(counters["best_top1"], val["val_top1"])
            metrics = dict(metrics, **val, epoch=epoch + 1, samples_seen=counters["samples_seen"],
                           step=counters["step"], restarts=counters["starts"] - 1, resizes=counters["resizes"],
                           epoch_progress=float(epoch + 1), best_top1=counters["best_top1"],
                           elapsed_s=counters["train_seconds"] + time.time() - clock[0],
                           device_seconds=counters["device_seconds"] + (time.time() - clock[0]) * world,
                           comm_bytes=comm.bytes_sent, phase=phase_idx, resolution=phase.resolution,
                           batch_size=phase.batch_size, world_size=world,
                           preemption_checkpoints=counters["preemption_checkpoints"])
            report(metrics)
            save("epoch", metrics)
            last_ckpt_time = time.time()
            if stopped:
                break
        if stopped:
            report({"event": "stopped", "samples_seen": counters["samples_seen"], "step": counters["step"]})
            break
    if sample_log is not None:
        sample_log.close()
    report({"event": "unit", "unit": "comm", "message": comm.describe(), "stats": comm.stats()})
    if rank == 0:
        report({"event": "end", "samples_seen": counters["samples_seen"], "wall_s": time.time() - t_start})
    if dist.is_initialized():
        dist.barrier()
