"""Gradient communication benchmark: bytes and time per step per mode vs dense, a projection to
16 nodes x 8 V100 on 25 Gbps, and accuracy after the same budget (dense vs top-k with/without EF).

    python -m bench.comm                      # everything (the accuracy part runs three demo trainings)
    python -m bench.comm --no-accuracy        # measured bytes/time + projection only
    python -m bench.comm --workers 2 --steps 2 --models resnet18

Measured part: ``--workers`` gloo processes (torch.multiprocessing) on this machine; for
hierarchical top-k they are laid out as 2 simulated nodes. Each runs real DDP steps of the
torchvision model (random 32 px inputs, batch 2: the gradients have the real sizes, the compute is
small) with each mode, and separately times the communication of the whole gradient alone
(``comm_s``: the hook's aggregate over 25 MB buckets, the same code DDP calls). Bytes are the byte
meter of ``app.train.comm`` (ring all-reduce 2(W-1)/W x size, all-gather (W-1) x payload).

Projection (alpha-beta model, no overlap of communication with compute, compression compute not
modelled), 16 nodes x 8 GPUs, W = 128:
  - inter-node: 25 Gbps per node (beta = 8 / 25e9 s per byte, one NIC per node shared by its 8 GPUs),
    alpha_inter = 30 us per message hop (TCP on a cloud VPC; an assumption, not a measurement here).
  - intra-node: NVLink, 100 GB/s all-reduce bus bandwidth, alpha_intra = 5 us (assumption, DGX-1 class).
  - dense ring over 128 ranks: 2(W-1)/W x S over the node NIC + 2(W-1) x alpha_inter per bucket (each
    synchronous ring step waits for its node-crossing hop). fp16/bf16: S/2.
  - flat top-k: ring all-gather of 8k bytes per rank (fp32 value + int32 index): (W-1) x 8k over the
    NIC + (W-1) alpha_inter per bucket, k = ratio x n.
  - hierarchical top-k: dense all-reduce in the node (NVLink), then the M=8 local ranks each all-gather
    the top-k of their 1/8 chunk across the 16 nodes, all 8 through the same NIC:
    (N-1) x 8 x ratio x n bytes + (N-1) alpha_inter per bucket, then an all-gather in the node.
  - PowerSGD rank r: P and Q all-reduced densely (ring) instead of each compressible matrix.
  - compute per step: V100 16 GB, mixed precision, 256 images per GPU. ResNet-50: 1200 img/s
    (NVIDIA DeepLearningExamples, PyTorch ResNet50 v1.5 README, DGX-1 16 GB, 1 GPU, NGC 21.03), so
    0.213 s. ResNet-18: no published V100 figure at hand; scaled from ResNet-50 by forward FLOPs
    (4.1 / 1.8 GFLOPs) to 2730 img/s, 0.094 s (an estimate).
  - scaling efficiency = compute / (compute + communication); ``overlap`` variant = compute /
    max(compute, communication) (perfect overlap, an upper bound).

Accuracy part: ``app.train.runner.run_training(load_config("demo", overrides))`` three times, the same
recipe and budget, with comm.mode dense, topk(0.01)+EF and topk(0.01) without EF.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import Machine, emit

MODES = ["dense", "fp16", "bf16", "topk", "hierarchical_topk", "powersgd"]
RATIO = 0.01
BUCKET_MB = 25.0

# --- projection constants (see module docstring) --------------------------------------------------
NODES, GPUS_PER_NODE = 16, 8
NIC_BYTES_PER_S = 25e9 / 8
ALPHA_INTER = 30e-6
INTRA_BYTES_PER_S = 100e9
ALPHA_INTRA = 5e-6
PER_GPU_BATCH = 256
V100_IMG_PER_S = {"resnet50": 1200.0, "resnet18": 1200.0 * 4.1 / 1.8}
V100_SOURCE = {"resnet50": "NVIDIA DeepLearningExamples PyTorch ResNet50 v1.5 README: DGX-1 16GB, 1 GPU, AMP, "
                           "1200 img/s (NGC 21.03)",
               "resnet18": "estimate: ResNet-50's 1200 img/s scaled by forward FLOPs 4.1/1.8"}


def _model(arch: str) -> torch.nn.Module:
    import torchvision

    torch.manual_seed(0)
    return getattr(torchvision.models, arch)(num_classes=1000)


def powersgd_elements(model: torch.nn.Module, rank: int, min_compression_rate: float = 2.0) -> int:
    """Elements PowerSGD all-reduces per step (P + Q of compressible matrices, the rest dense)."""
    total = 0
    for p in model.parameters():
        if p.dim() > 1:
            rows, cols = p.shape[0], p.numel() // p.shape[0]
            r = min(rows, cols, rank)
            if (rows + cols) * r * min_compression_rate < rows * cols:
                total += (rows + cols) * r
                continue
        total += p.numel()
    return total


def project(arch: str, n_elems: int, psgd_elems: int, ratio: float = RATIO) -> dict[str, Any]:
    """Alpha-beta step time and scaling efficiency per mode at 16 x 8 V100 on 25 Gbps."""
    w, n_nodes, m = NODES * GPUS_PER_NODE, NODES, GPUS_PER_NODE
    s = 4.0 * n_elems
    buckets = max(1, math.ceil(s / (BUCKET_MB * 1024 * 1024)))

    def ring(nbytes: float, msgs: int) -> float:
        return 2 * (w - 1) / w * nbytes / NIC_BYTES_PER_S + msgs * 2 * (w - 1) * ALPHA_INTER

    k = ratio * n_elems
    comm = {
        "dense": ring(s, buckets),
        "fp16": ring(s / 2, buckets),
        "bf16": ring(s / 2, buckets),
        "topk": (w - 1) * 8 * k / NIC_BYTES_PER_S + buckets * (w - 1) * ALPHA_INTER,
        "hierarchical_topk": (2 * (m - 1) / m * s / INTRA_BYTES_PER_S + buckets * 2 * (m - 1) * ALPHA_INTRA
                              + (n_nodes - 1) * 8 * k / NIC_BYTES_PER_S + buckets * (n_nodes - 1) * ALPHA_INTER
                              + (m - 1) / m * s / INTRA_BYTES_PER_S + buckets * (m - 1) * ALPHA_INTRA),
        "powersgd": ring(4.0 * psgd_elems, 2 * buckets),
    }
    compute = PER_GPU_BATCH / V100_IMG_PER_S[arch]
    out: dict[str, Any] = {"compute_s": round(compute, 4), "compute_source": V100_SOURCE[arch], "modes": {}}
    for mode, t in comm.items():
        out["modes"][mode] = {"comm_s": round(t, 5), "step_s": round(compute + t, 5),
                              "efficiency": round(compute / (compute + t), 4),
                              "efficiency_overlap": round(compute / max(compute, t), 4)}
    return out


# --- measured part --------------------------------------------------------------------------------
def _step(ddp: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()


def _measure_worker(rank: int, world: int, folder: str, arch: str, steps: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from app.config import CommConfig
    from app.train.comm import CommHook
    from app.train.topology import Topology

    dist.init_process_group("gloo", init_method=f"file://{folder}/store-{arch}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    topo = Topology.simulated(world, rank, max(1, world // 2))
    model = _model(arch)
    n = sum(p.numel() for p in model.parameters())
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 1000, (2,), generator=torch.Generator().manual_seed(rank))
    results: dict[str, Any] = {"elements": n}
    for mode in MODES:
        cfg = CommConfig(mode=mode, ratio=RATIO, warmup_steps=0, error_feedback=True, bucket_mb=BUCKET_MB)
        m = _model(arch)
        ddp = DDP(m, bucket_cap_mb=BUCKET_MB)
        hook = CommHook(cfg, topo, torch.device("cpu"))
        hook.install(ddp)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)

        for _ in range(2 if mode == "powersgd" else 1):  # warm-up (PowerSGD compresses from its 3rd step)
            _step(ddp, opt, x, y)
        b0, i0, d0 = hook.bytes_sent, hook.bytes_inter_node, hook.dense_bytes
        times = []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            _step(ddp, opt, x, y)
            times.append(time.perf_counter() - t0)
        rec = {"step_s": statistics.median(times), "bytes": (hook.bytes_sent - b0) / steps,
               "inter_bytes": (hook.bytes_inter_node - i0) / steps, "dense_bytes": (hook.dense_bytes - d0) / steps}
        if mode != "powersgd":
            # Communication alone: the whole gradient in 25 MB buckets through the same hook code.
            grads = torch.randn(n, generator=torch.Generator().manual_seed(100 + rank))
            chunk = int(BUCKET_MB * 1024 * 1024 / 4)
            pieces = grads.split(chunk)
            ctimes = []
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                for i, p in enumerate(pieces):
                    hook.aggregate(p, [(f"b{i}", p.numel())], bucket_index=10_000 + i, last=i == len(pieces) - 1)
                ctimes.append(time.perf_counter() - t0)
            rec["comm_s"] = statistics.median(ctimes)
        t = torch.tensor([rec["step_s"], rec.get("comm_s", 0.0)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the step
        rec["step_s"], rec["comm_s"] = float(t[0]), float(t[1]) if mode != "powersgd" else None
        results[mode] = rec
    if rank == 0:
        torch.save(results, os.path.join(folder, f"res-{arch}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown: ~20 s per process on a loaded 2-core machine


def measure(arch: str, workers: int, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_measure_worker, args=(workers, folder, arch, steps), nprocs=workers, join=True)
        return torch.load(os.path.join(folder, f"res-{arch}.pt"), weights_only=False)


# --- accuracy part ---------------------------------------------------------------------------------
ACCURACY_VARIANTS = {
    "dense": {"comm.mode": "dense"},
    "topk_ef": {"comm.mode": "topk", "comm.ratio": RATIO, "comm.error_feedback": True},
    "topk_no_ef": {"comm.mode": "topk", "comm.ratio": RATIO, "comm.error_feedback": False},
}


def accuracy(storage: str, extra: dict[str, Any]) -> dict[str, Any]:
    try:
        from app.config import load_config
        from app.train.runner import run_training
    except ImportError as exc:
        return {"error": f"app.train.runner.run_training not available ({exc})"}
    out: dict[str, Any] = {}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # The trainings print progress and Ray relays worker logs to fd 1: send all of it to stderr so
    # stdout carries only the bench's JSON line.
    sys.stdout.flush()
    saved_fd = os.dup(1)
    os.dup2(2, 1)
    try:
        _accuracy_runs(storage, extra, stamp, out, load_config, run_training)
    finally:
        sys.stdout.flush()
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
    return out


def _accuracy_runs(storage: str, extra: dict[str, Any], stamp: str, out: dict[str, Any], load_config: Any,
                   run_training: Any) -> None:
    for name, overrides in ACCURACY_VARIANTS.items():
        # A fresh local Ray cluster: "auto" would join whatever cluster runs on this machine.
        ov = {"scaling.ray_address": "local", **overrides, **extra, "name": f"bench-comm-{name}-{stamp}",
              "storage": storage}
        try:
            cfg = load_config("demo", ov)
            t0 = time.time()
            summary = run_training(cfg, progress=False)
            out[name] = {"final_top1": summary.get("final_top1"), "best_top1": summary.get("best_top1"),
                         "comm_bytes": summary.get("comm_bytes_per_worker"),
                         "wall_s": round(time.time() - t0, 1)}
        except Exception as exc:  # noqa: BLE001 - one failed variant must not hide the others' figures
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            import ray

            ray.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.comm", description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=4, help="gloo processes (2..4)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode")
    ap.add_argument("--models", default="resnet18,resnet50")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the three demo trainings")
    ap.add_argument("--storage", default="", help="run folder root for the accuracy part (default: a temp dir)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override for the accuracy runs (e.g. schedule.epochs=4)")
    args = ap.parse_args(argv)
    machine = Machine()
    if not 2 <= args.workers <= 4:
        ap.error(f"--workers: bad value {args.workers}; expected 2..4")
    figures: dict[str, Any] = {"ratio": RATIO, "workers": args.workers, "bucket_mb": BUCKET_MB}
    ratios: dict[str, float] = {}
    for arch in [a.strip() for a in args.models.split(",") if a.strip()]:
        res = measure(arch, args.workers, args.steps)
        dense = res["dense"]
        figures[arch] = {"elements": res["elements"], "measured": {}}
        for mode in MODES:
            r = res[mode]
            figures[arch]["measured"][mode] = {
                "bytes_per_step": int(r["bytes"]), "inter_node_bytes_per_step": int(r["inter_bytes"]),
                "bytes_vs_dense": round(r["bytes"] / dense["bytes"], 5),
                "inter_node_bytes_vs_dense": round(r["inter_bytes"] / dense["inter_bytes"], 5),
                "step_s": round(r["step_s"], 4),
                "comm_s": None if r["comm_s"] is None else round(r["comm_s"], 4)}
            if mode != "dense":
                ratios[f"{arch}_bytes_dense_over_{mode}"] = round(dense["bytes"] / max(r["bytes"], 1), 3)
                ratios[f"{arch}_inter_node_bytes_dense_over_{mode}"] = round(
                    dense["inter_bytes"] / max(r["inter_bytes"], 1), 3)
                ratios[f"{arch}_step_time_dense_over_{mode}"] = round(dense["step_s"] / r["step_s"], 3)
        m = _model(arch)
        proj = project(arch, res["elements"], powersgd_elements(m, 2))
        figures[arch]["projection_16x8_v100_25gbps"] = proj
        for mode in MODES:
            if mode != "dense":
                ratios[f"{arch}_projected_step_dense_over_{mode}"] = round(
                    proj["modes"]["dense"]["step_s"] / proj["modes"][mode]["step_s"], 3)
    figures["projection_constants"] = {
        "nic_gbps": NIC_BYTES_PER_S * 8 / 1e9, "alpha_inter_s": ALPHA_INTER, "intra_GBps": INTRA_BYTES_PER_S / 1e9,
        "alpha_intra_s": ALPHA_INTRA, "per_gpu_batch": PER_GPU_BATCH, "nodes": NODES, "gpus_per_node": GPUS_PER_NODE}
    if not args.no_accuracy:
        extra = dict(kv.split("=", 1) for kv in args.set)
        storage = args.storage or tempfile.mkdtemp(prefix="bench-comm-")
        acc = accuracy(storage, extra)
        figures["accuracy_demo"] = acc
        d, e, ne = (acc.get(k, {}).get("final_top1") for k in ("dense", "topk_ef", "topk_no_ef"))
        if d and e:
            ratios["top1_topk_ef_over_dense"] = round(e / d, 4)
        if e and ne:
            ratios["top1_topk_ef_over_topk_no_ef"] = round(e / ne, 4)
    emit("comm", figures, ratios, machine.finish(argv, backend="gloo (CPU)"))


if __name__ == "__main__":
    main()
