"""Gradient communication benchmark: bytes and time per step per mode vs dense, overlap per bucket,
compression's own compute at ResNet-50 size, a projection to 16 nodes x 8 V100 on 25 Gbps, and (with
``--accuracy``) demo top-1 after the same budget, dense vs top-k 0.01 with error feedback.

    python -m bench.comm                      # measured bytes/time/overlap/overhead + projection
    python -m bench.comm --accuracy           # + demo trainings (python app/run.py), several minutes each
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

Bytes: ``bytes_per_step`` is the hook's meter (the modelled wire bytes of ring all-reduce and
all-gather); ``handed_bytes_per_step`` counts the bytes of the tensors the hook actually hands to
``torch.distributed.all_reduce`` / ``all_gather`` (wrapped in the measuring processes), i.e. each
worker's own payload per collective, before the algorithm's (W-1)/W factors.

Overlap: during the timed steps the hook records, per bucket, when DDP called it and when its future
completed. ``overlap_frac`` is the share of those collective intervals that falls before the last
bucket's hook call (while backward was still computing); a synchronous hook scores 0.

Compression overhead (``compress_overhead_frac``): the hook's own compute for one step (error feedback,
momentum correction, selection, packing, residual update; no communication) over every bucket of
ResNet-50's gradient (torchvision parameter sizes, 25 MB buckets), on this CPU, divided by a measured
forward + backward of ResNet-50 at ``--overhead-batch`` images of 224 px on the same CPU. Both figures and
the batch are printed: the fraction shrinks as the batch grows.

Crossover: with per-worker inter-node bytes B (measured meter; the slow link) and compression compute C
(above, scaled from ResNet-50's element count to the model's), a mode beats dense below the inter-node
link bandwidth ``8 (B_dense - B_mode) / C`` bit/s (alpha-beta model, no overlap, intra-node traffic
taken as free; dense's own compute is the same on both sides and cancels).

Accuracy (``--accuracy``): ``python app/run.py --storage S --name N --scaling.ray_address=local`` per
variant (the demo recipe, same seed and budget), dense against top-k 0.01 with error feedback and the DGC
units; ``ratios.top1_topk_ef_over_dense`` is final top-1 of the latter over dense's. Without the flag the
key is absent and ``figures.accuracy_demo`` says so.

``comm.mode=auto`` (choosing dense / bf16 / hierarchical top-k from the link speed) is not built.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
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
SELECTION = "sampled"

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


class _Handed:
    """Counts the bytes of the tensors handed to torch.distributed's all_reduce / all_gather (own payload)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._orig = (dist.all_reduce, dist.all_gather)

        def all_reduce(tensor: torch.Tensor, *a: Any, **kw: Any) -> Any:
            self.bytes += tensor.numel() * tensor.element_size()
            return self._orig[0](tensor, *a, **kw)

        def all_gather(outs: list, tensor: torch.Tensor, *a: Any, **kw: Any) -> Any:
            self.bytes += tensor.numel() * tensor.element_size()
            return self._orig[1](outs, tensor, *a, **kw)

        dist.all_reduce, dist.all_gather = all_reduce, all_gather  # type: ignore[assignment]


def _overlap(timings: list[tuple[int, float, float]], t_backward: float) -> dict[str, Any]:
    """Per-bucket (call, done) offsets from backward's start, and the share of collective time before the
    last hook call."""
    last_call = max(c for _, c, _ in timings)
    total = sum(d - c for _, c, d in timings)
    before = sum(max(0.0, min(d, last_call) - c) for _, c, d in timings)
    return {"overlap_frac": round(before / total, 4) if total > 0 else 0.0,
            "buckets": [{"bucket": i, "call_ms": round(1e3 * (c - t_backward), 2),
                         "done_ms": round(1e3 * (d - t_backward), 2)} for i, c, d in timings]}


def _measure_worker(rank: int, world: int, folder: str, arch: str, steps: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from app.config import CommConfig
    from app.train.comm import CommHook
    from app.train.topology import Topology

    dist.init_process_group("gloo", init_method=f"file://{folder}/store-{arch}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    handed = _Handed()
    topo = Topology.simulated(world, rank, max(1, world // 2))
    model = _model(arch)
    n = sum(p.numel() for p in model.parameters())
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 1000, (2,), generator=torch.Generator().manual_seed(rank))
    results: dict[str, Any] = {"elements": n}
    for mode in MODES:
        cfg = CommConfig(mode=mode, ratio=RATIO, warmup_steps=0, error_feedback=True, bucket_mb=BUCKET_MB,
                         selection=SELECTION)
        m = _model(arch)
        ddp = DDP(m, bucket_cap_mb=BUCKET_MB)
        hook = CommHook(cfg, topo, torch.device("cpu"))
        hook.install(ddp)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)

        for _ in range(2 if mode == "powersgd" else 1):  # warm-up (PowerSGD compresses from its 3rd step)
            _step(ddp, opt, x, y)
        b0, i0, d0, h0 = hook.bytes_sent, hook.bytes_inter_node, hook.dense_bytes, handed.bytes
        times, backward = [], []
        for _ in range(steps):
            dist.barrier()
            hook.bucket_timings = []
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            tb = time.perf_counter()
            loss.backward()
            backward.append(time.perf_counter() - tb)
            opt.step()
            times.append(time.perf_counter() - t0)
        timings = hook.bucket_timings
        hook.bucket_timings = None
        rec = {"step_s": statistics.median(times), "bytes": (hook.bytes_sent - b0) / steps,
               "inter_bytes": (hook.bytes_inter_node - i0) / steps, "dense_bytes": (hook.dense_bytes - d0) / steps,
               "handed_bytes": (handed.bytes - h0) / steps, "backward_s": statistics.median(backward),
               **_overlap(timings, tb)}
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


# --- compression overhead at ResNet-50 size -------------------------------------------------------
def _buckets(model: torch.nn.Module, bucket_mb: float) -> list[list[tuple[str, int]]]:
    """Parameters in DDP's (reverse) order, cut into buckets of about ``bucket_mb``."""
    cap = int(bucket_mb * 1024 * 1024 / 4)
    out: list[list[tuple[str, int]]] = [[]]
    size = 0
    for name, p in reversed(list(model.named_parameters())):
        if size and size + p.numel() > cap:
            out.append([])
            size = 0
        out[-1].append((name, p.numel()))
        size += p.numel()
    return out


def compress_overhead(batch: int, ratio: float, reps: int = 3) -> dict[str, Any]:
    """Seconds of the hook's own compute per step over ResNet-50's gradient buckets, per selection method
    and with/without the DGC units, against a measured ResNet-50 forward + backward on this CPU."""
    from app.config import CommConfig
    from app.train.comm import CommHook
    from app.train.compress import k_for
    from app.train.topology import Topology

    model = _model("resnet50")
    buckets = _buckets(model, BUCKET_MB)
    x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 1000, (batch,), generator=torch.Generator().manual_seed(1))
    fb = []
    for _ in range(2):
        model.zero_grad()
        t0 = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        fb.append(time.perf_counter() - t0)
    grads = {n: p.grad.reshape(-1).clone() for n, p in model.named_parameters()}
    topo = Topology.simulated(2, 0, 1)  # only for the hook's bookkeeping: no collective runs here
    variants = {"exact": {"selection": "exact"}, "sampled": {"selection": "sampled"},
                "sampled_dgc": {"selection": "sampled", "momentum_correction": True, "momentum_masking": True},
                "sampled_dgc_per_layer": {"selection": "sampled", "momentum_correction": True, "momentum_masking": True,
                                          "per_layer": True}}
    out: dict[str, Any] = {"batch": batch, "resolution": 224, "threads": torch.get_num_threads(),
                           "forward_backward_s": round(min(fb), 4), "buckets": len(buckets),
                           "elements": sum(n for b in buckets for _, n in b), "ratio": ratio, "seconds": {}}
    for name, kw in variants.items():
        hook = CommHook(CommConfig(mode="topk", ratio=ratio, warmup_steps=0, **kw), topo, torch.device("cpu"))
        hook.optimizer_momentum(0.9)
        flats = [torch.cat([grads[n] for n, _ in b]) for b in buckets]
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            for i, (flat, layout) in enumerate(zip(flats, buckets)):
                acc, residual, u = hook._accumulate(flat, i, layout, flat.numel(), 0, flat.numel(), 1.0)
                segments = [m for _, m in layout] if hook.cfg.per_layer else None
                packed, k = hook._sparsify(acc, residual, u, segments)
                assert packed.numel() == 2 * sum(k_for(hook.ratio_now, m) for m in segments or [flat.numel()])
            best = min(best, time.perf_counter() - t0)
        out["seconds"][name] = round(best, 4)
        out[f"frac_{name}"] = round(best / min(fb), 4)
        if name == "sampled":
            out["sampled_selection"] = {"calls": hook.selection.calls, "sampled": hook.selection.sampled,
                                        "fallbacks": hook.selection.fallbacks,
                                        "padded_entries": hook.selection.padded_entries}
    return out


def crossover_gbps(dense_bytes: float, mode_bytes: float, extra_s: float) -> float | None:
    """Link speed (Gbit/s) below which sending ``mode_bytes`` plus ``extra_s`` of compute beats ``dense_bytes``."""
    if extra_s <= 0 or mode_bytes >= dense_bytes:
        return None
    return round(8 * (dense_bytes - mode_bytes) / extra_s / 1e9, 3)


# --- accuracy part ---------------------------------------------------------------------------------
DGC_FLAGS = ["--comm.momentum_correction=true", "--comm.momentum_masking=true", "--comm.sparsity_warmup_epochs=2",
             "--comm.selection=sampled"]
ACCURACY_VARIANTS = {
    "dense": [],
    "topk_ef": ["--comm.mode=topk", f"--comm.ratio={RATIO}", *DGC_FLAGS],
}


def accuracy(storage: str, extra: list[str], epochs: float | None, plain: bool) -> dict[str, Any]:
    """Demo trainings through ``python app/run.py``, each on its own local Ray cluster, the same seed and budget."""
    from bench.common import REPO

    variants = dict(ACCURACY_VARIANTS)
    if plain:
        variants["topk_ef_plain"] = ["--comm.mode=topk", f"--comm.ratio={RATIO}"]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out: dict[str, Any] = {}
    for name, flags in variants.items():
        run = f"bench-comm-{name}-{stamp}"
        cmd = [sys.executable, "app/run.py", "--storage", storage, "--name", run, "--scaling.ray_address=local",
               *flags, *([f"--schedule.epochs={epochs:g}"] if epochs else []), *extra]
        t0 = time.time()
        # Progress and Ray's logs go to stderr: stdout carries only the bench's JSON line.
        proc = subprocess.run(cmd, cwd=REPO, stdout=sys.stderr, stderr=sys.stderr)
        rec: dict[str, Any] = {"command": " ".join(cmd[1:]), "rc": proc.returncode,
                               "wall_s": round(time.time() - t0, 1)}
        try:
            with open(os.path.join(storage, run, "summary.json")) as f:
                summary = json.load(f)
            rec.update(final_top1=summary.get("final_top1"), best_top1=summary.get("best_top1"),
                       comm_bytes=summary.get("comm_bytes_per_worker"))
        except (OSError, ValueError) as exc:
            rec["error"] = f"no summary.json ({exc})"
        out[name] = rec
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.comm", description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=4, help="gloo processes (2..4)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode")
    ap.add_argument("--models", default="resnet18,resnet50")
    ap.add_argument("--accuracy", action="store_true", help="also run the demo trainings (several minutes each)")
    ap.add_argument("--accuracy-plain", action="store_true", help="with --accuracy: also top-k + EF without DGC units")
    ap.add_argument("--epochs", type=float, default=None, help="demo epochs for --accuracy (default: the recipe's)")
    ap.add_argument("--no-accuracy", action="store_true", help="(default) no demo trainings")
    ap.add_argument("--overhead-batch", type=int, default=8, help="ResNet-50 batch for the overhead's fwd+bwd")
    ap.add_argument("--storage", default="", help="run folder root for the accuracy part (default: a temp dir)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override for the accuracy runs (e.g. data.train_size=2000)")
    args = ap.parse_args(argv)
    machine = Machine()
    if not 2 <= args.workers <= 4:
        ap.error(f"--workers: bad value {args.workers}; expected 2..4")
    figures: dict[str, Any] = {"ratio": RATIO, "workers": args.workers, "bucket_mb": BUCKET_MB,
                               "selection": SELECTION, "auto_mode": "not built"}
    ratios: dict[str, float] = {}
    over = compress_overhead(args.overhead_batch, RATIO)
    figures["compress_overhead"] = over
    figures["compress_overhead_frac"] = over[f"frac_{SELECTION}"]
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
                "handed_bytes_per_step": int(r["handed_bytes"]),
                "step_s": round(r["step_s"], 4), "step_vs_dense": round(r["step_s"] / dense["step_s"], 3),
                "backward_s": round(r["backward_s"], 4), "overlap_frac": r["overlap_frac"],
                "buckets_last_step": r["buckets"][-8:],
                "comm_s": None if r["comm_s"] is None else round(r["comm_s"], 4)}
            if mode in ("topk", "hierarchical_topk"):
                figures[arch]["measured"][mode]["crossover_gbps"] = crossover_gbps(
                    dense["inter_bytes"], r["inter_bytes"],
                    over["seconds"][SELECTION] * res["elements"] / over["elements"])
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
    figures["crossover_model"] = ("crossover_gbps = 8 (dense inter-node bytes - mode inter-node bytes) / compress_s "
                                  "per worker and step; compress_s = compress_overhead.seconds[selection] scaled by "
                                  "the model's elements over ResNet-50's")
    if args.accuracy:
        storage = args.storage or tempfile.mkdtemp(prefix="bench-comm-")
        acc = accuracy(storage, [f"--{kv}" for kv in args.set], args.epochs, args.accuracy_plain)
        figures["accuracy_demo"] = acc
        d, e, p = (acc.get(k, {}).get("final_top1") for k in ("dense", "topk_ef", "topk_ef_plain"))
        if d and e:
            ratios["top1_topk_ef_over_dense"] = round(e / d, 4)
        if d and p:
            ratios["top1_topk_ef_plain_over_dense"] = round(p / d, 4)
    else:
        figures["accuracy_demo"] = "not run (pass --accuracy): ratios.top1_topk_ef_over_dense is absent"
    emit("comm", figures, ratios, machine.finish(argv, backend="gloo (CPU)"))


if __name__ == "__main__":
    main()
