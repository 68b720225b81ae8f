"""Gradient communication benchmark: bytes and time per step per mode vs dense, overlap per bucket,
compression's own compute at ResNet-50 size, an overlap-aware projection to 16 nodes x 8 V100 on 25 Gbps
against a flat and a hierarchical dense all-reduce, the crossover link speed per mode, and (with
``--accuracy``) demo top-1 after the same budget, dense vs top-k 0.01 and 0.001 with error feedback.

    python -m bench.comm                      # measured bytes/time/overlap/overhead + projection
    python -m bench.comm --accuracy           # + demo trainings (python app/run.py), several minutes each
    python -m bench.comm --workers 2 --steps 2 --models resnet18

Measured part: ``--workers`` gloo processes (torch.multiprocessing) on this machine, laid out as 2
simulated nodes (hierarchical top-k needs them). Each runs real DDP steps of the torchvision model
(random 32 px inputs, batch 2: the gradients have the real sizes, the compute is small) with each
mode, and separately times the communication of the whole gradient alone (``comm_s``: the hook's
aggregate over 25 MB buckets, the same code DDP calls).

Bytes, two kinds, labelled in every key:
- ``counted_*``: counted here. ``torch.distributed.all_reduce`` / ``all_gather`` are wrapped in the
  measuring processes; every tensor the hooks (lightray's and torch's PowerSGD) hand them adds its
  bytes, per step, in total and by process group (``world``, ``node``: inside a simulated node,
  ``cross_node``: hierarchical top-k's group of same-local-rank workers). That is each worker's own
  payload per collective, before the algorithm multiplies it on the wire.
- ``modelled_*``: the hook's byte meter, a formula over what was handed: ring all-reduce 2(W-1)/W x size,
  all-gather (W-1) x payload; ``modelled_inter_node_*`` the part that crosses nodes.

Overlap (measured): during the timed steps the hook records, per bucket, when DDP called it and when its
future completed. ``overlap_frac`` is the share of those collective intervals that falls before the last
bucket's hook call (while backward was still computing); a synchronous hook scores 0.
``backward_window_share``: of the measured backward (dense mode), the share from the first bucket's hook
call to the last: the compute that asynchronous collectives can hide behind.

Compression overhead (``compress_overhead_frac``, measured): the hook's own compute for one step (error
feedback, momentum correction, selection, packing, residual update; no communication) over every bucket
of ResNet-50's gradient (torchvision parameter sizes, 25 MB buckets), on this CPU, divided by a measured
forward + backward of ResNet-50 at ``--overhead-batch`` images of 224 px on the same CPU. Both figures
and the batch are printed: the fraction shrinks as the batch grows. With a CUDA device visible the same is
measured there too (``compress_overhead_gpu``).

Projection and crossover (modelled; ``lightray.comm.auto``, the model ``comm.mode=auto`` decides with, its
formula and every input written out under ``projection``): alpha-beta collectives over one link per node and
fast links inside it, and an overlap-aware step:
``step_s = compute_s + extra_s + sync_s + max(0, async_s - overlap_s)``.
Inputs: 16 nodes x 8 GPUs, 25 Gbps per node, alpha 30 us between nodes and 5 us inside (assumptions),
100 GB/s NVLink-class all-reduce inside a node (assumption); compute per step on a V100 16 GB, mixed
precision, 256 images per GPU: ResNet-50 1200 img/s (NVIDIA DeepLearningExamples, PyTorch ResNet50 v1.5
README, DGX-1 16 GB, 1 GPU, NGC 21.03), so 0.213 s; ResNet-18 scaled from it by forward FLOPs (4.1 / 1.8; an
estimate); the overlap window = compute_s x the backward share of a step (2/3: backward costs about twice the
forward) x ``backward_window_share`` measured here; compression and cast compute measured here (on the GPU
when there is one, else this CPU's figure: an upper bound for a GPU, said so in ``inputs``), scaled by
elements from ResNet-50's. Modes: flat ring dense, hierarchical dense (the comparator: reduce-scatter in the
node, all-reduce across nodes, all-gather in the node), fp16/bf16, top-k, hierarchical top-k, PowerSGD.
``figures.crossover_gbps`` (per mode, for the first model): the link speed below which the mode's modelled
step beats the flat dense ring's; ``figures.<arch>.crossover_here_gbps``: the same with this machine's
measured compute (2 simulated nodes, CPU shared-memory links inside a node).

Inter-node bytes, dense over hierarchical top-k (``figures.inter_node_bytes_dense_over_hierarchical_topk``), at
ratios 0.01 and 0.001, each with the compact payload (fp16 values + 16-bit index offsets, 4 bytes an entry) and
the fp32 one (8 bytes): ``modelled`` by ``lightray.comm.auto`` for 16 nodes x 8 GPUs and the first model's
gradient; ``counted`` from one step of the whole gradient through the hook on the simulated nodes here (bytes
handed to the wrapped collectives: S per worker for dense, B per node for the cross-node all-gathers), turned into
the per-link ratio 2 S / (N B) for the nodes here and for N = 16 (the formula is printed with the figure).
``figures.goals.inter_node_bytes_100x`` says per ratio whether both reach 100x; ``ratios`` carries the counted
16-node figures.

Accuracy (``--accuracy``): ``python app/run.py --storage S --name N --scaling.ray_address=local`` per
variant (the demo recipe, same seed and budget; ``--seed`` sets ``scaling.seed`` of every run,
``--accuracy-variants`` picks them), dense against top-k 0.01 and 0.001 with error feedback, the DGC units and
the compact payload; ``ratios.top1_topk_ef_over_dense`` (0.01) and ``ratios.top1_topk_ef_0001_over_dense``
(0.001) are final top-1 of those over dense's. Without the flag the keys are absent and
``figures.accuracy_demo`` says so.
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
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import Machine, emit
from lightray.comm import auto as comm_auto

MODES = ["dense", "fp16", "bf16", "topk", "hierarchical_topk", "powersgd"]
PROJECTED_MODES = ["dense", "hierarchical_dense", "fp16", "bf16", "topk", "hierarchical_topk", "powersgd"]
RATIO = 0.01
BUCKET_MB = 25.0
SELECTION = "sampled"
PAYLOAD = "compact"  # comm.payload of the measured sparse modes
BYTES_RATIOS = (0.01, 0.001)  # inter-node bytes, dense over hierarchical top-k, at these ratios
BYTES_GOAL = 100.0  # hierarchical top-k keeps inter-node bytes at least this far below dense

# --- projection inputs (see module docstring) -----------------------------------------------------
NODES, GPUS_PER_NODE = 16, 8
LINK_GBPS = 25.0
PER_GPU_BATCH = 256
BACKWARD_SHARE = 2 / 3  # backward's share of forward + backward (backward costs about twice the forward)
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


def n_buckets(elements: int) -> int:
    return max(1, math.ceil(4.0 * elements / (BUCKET_MB * 1024 * 1024)))


def project(arch: str, n_elems: int, psgd_elems: int, compress_s: float, cast_s: float, window_share: float,
            compress_source: str, ratio: float = RATIO) -> dict[str, Any]:
    """The overlap-aware model (lightray.comm.auto) at 16 x 8 V100 on 25 Gbps: per mode the modelled step, its
    parts, the scaling efficiency and the crossover link speed, with the model and every input."""
    compute = PER_GPU_BATCH / V100_IMG_PER_S[arch]
    cluster = comm_auto.Cluster(NODES, GPUS_PER_NODE, LINK_GBPS, comm_auto.INTRA_GBPS["cuda"])
    costs = comm_auto.StepCosts(elements=n_elems, buckets=n_buckets(n_elems), ratio=ratio, compress_s=compress_s,
                                cast_s=cast_s, overlap_s=compute * BACKWARD_SHARE * window_share, compute_s=compute,
                                powersgd_elements=psgd_elems, payload=PAYLOAD)
    rows = comm_auto.table(cluster, costs, PROJECTED_MODES)
    for row in rows.values():
        row["efficiency"] = round(compute / row["step_s"], 4)
    pick, why, _ = comm_auto.choose(cluster, costs, ["bf16", "hierarchical_topk"])
    return {"model": comm_auto.FORMULA, "modes": rows, "auto_picks": pick, "auto_why": why,
            "inputs": {"cluster": asdict(cluster), "costs": asdict(costs),
                       "sources": {"compute_s": V100_SOURCE[arch],
                                   "overlap_s": f"compute_s x {BACKWARD_SHARE:.3f} (backward share, assumed) x "
                                                f"{window_share:.4f} (backward window share, measured here)",
                                   "compress_s / cast_s": compress_source,
                                   "alphas, intra_gbps": "assumptions (TCP cloud network, NVLink-class node)",
                                   "powersgd": "its compute not modelled (extra_s 0): a lower bound"}}}


# --- measured part --------------------------------------------------------------------------------
class _Handed:
    """Counts the bytes of the tensors handed to torch.distributed's all_reduce / all_gather (own payload), in
    total and per process group (``names``: id of a group -> its name; no group = ``world``)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.by_group: dict[str, int] = {}
        self.names: dict[int, str] = {}
        self._orig = (dist.all_reduce, dist.all_gather)

        def count(tensor: torch.Tensor, group: Any) -> None:
            nbytes = tensor.numel() * tensor.element_size()
            self.bytes += nbytes
            name = "world" if group is None or group is dist.group.WORLD else self.names.get(id(group), "other")
            self.by_group[name] = self.by_group.get(name, 0) + nbytes

        def all_reduce(tensor: torch.Tensor, *a: Any, **kw: Any) -> Any:
            count(tensor, kw.get("group", a[1] if len(a) > 1 else None))
            return self._orig[0](tensor, *a, **kw)

        def all_gather(outs: list, tensor: torch.Tensor, *a: Any, **kw: Any) -> Any:
            count(tensor, kw.get("group", a[0] if a else None))
            return self._orig[1](outs, tensor, *a, **kw)

        dist.all_reduce, dist.all_gather = all_reduce, all_gather  # type: ignore[assignment]


def _overlap(timings: list[tuple[int, float, float]], t_backward: float) -> dict[str, Any]:
    """Per-bucket (call, done) offsets from backward's start, and the share of collective time before the
    last hook call."""
    last_call = max(c for _, c, _ in timings)
    total = sum(d - c for _, c, d in timings)
    before = sum(max(0.0, min(d, last_call) - c) for _, c, d in timings)
    return {"overlap_frac": round(before / total, 4) if total > 0 else 0.0,
            "window_s": last_call - min(c for _, c, _ in timings),
            "buckets": [{"bucket": i, "call_ms": round(1e3 * (c - t_backward), 2),
                         "done_ms": round(1e3 * (d - t_backward), 2)} for i, c, d in timings]}


def _timed_steps(hook: Any, handed: _Handed, ddp: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                 y: torch.Tensor, steps: int) -> dict[str, Any]:
    """``steps`` timed training steps through the installed hook: per step the median time and backward time,
    bytes sent, inter-node, dense and handed to the collectives (by group), and the buckets' overlap."""
    b0, i0, d0, h0 = hook.bytes_sent, hook.bytes_inter_node, hook.dense_bytes, handed.bytes
    g0 = dict(handed.by_group)
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
    ov = _overlap(timings, tb)
    return {"step_s": statistics.median(times), "bytes": (hook.bytes_sent - b0) / steps,
            "inter_bytes": (hook.bytes_inter_node - i0) / steps, "dense_bytes": (hook.dense_bytes - d0) / steps,
            "handed_bytes": (handed.bytes - h0) / steps,
            "handed_by_group": {k: (v - g0.get(k, 0)) / steps for k, v in handed.by_group.items()
                                if v != g0.get(k, 0)},
            "backward_s": statistics.median(backward), "window_share": ov.pop("window_s") / backward[-1], **ov}


def _comm_alone(hook: Any, n: int, rank: int, steps: int) -> float:
    """Median seconds of communication alone: the whole gradient in 25 MB buckets through the same hook code."""
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
    return statistics.median(ctimes)


def _measure_mode(mode: str, arch: str, topo: Any, handed: _Handed, x: torch.Tensor, y: torch.Tensor, n: int,
                  rank: int, steps: int) -> dict[str, Any]:
    """One comm mode on this rank: a fresh DDP model with lightray's hook, warmed up, then timed steps and (but
    for PowerSGD) communication alone; step and comm seconds are the slowest rank's."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightray.comm.hook import CommHook
    from lightray.config import CommConfig

    # builtin=False: every mode through lightray's hook, which this bench times per bucket and whose bytes it counts
    cfg = CommConfig(mode=mode, ratio=RATIO, warmup_steps=0, error_feedback=True, bucket_mb=BUCKET_MB,
                     selection=SELECTION, payload=PAYLOAD, builtin=False)
    m = _model(arch)
    ddp = DDP(m, bucket_cap_mb=BUCKET_MB)
    hook = CommHook(cfg, topo, torch.device("cpu"))
    hook.install(ddp)
    handed.names = hook.groups.named() if hook.groups is not None else {}
    opt = torch.optim.SGD(m.parameters(), lr=0.01)

    for _ in range(2 if mode == "powersgd" else 1):  # warm-up (PowerSGD compresses from its 3rd step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    rec = _timed_steps(hook, handed, ddp, opt, x, y, steps)
    if mode != "powersgd":
        # Communication alone: the whole gradient in 25 MB buckets through the same hook code.
        rec["comm_s"] = _comm_alone(hook, n, rank, steps)
    t = torch.tensor([rec["step_s"], rec.get("comm_s", 0.0)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the step
    rec["step_s"], rec["comm_s"] = float(t[0]), float(t[1]) if mode != "powersgd" else None
    return rec


def _measure_worker(rank: int, world: int, folder: str, arch: str, steps: int) -> None:
    from lightray.comm.topology import Topology

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
        results[mode] = _measure_mode(mode, arch, topo, handed, x, y, n, rank, steps)
    results["bytes_pass"] = _bytes_pass(topo, n, rank, handed)
    if rank == 0:
        torch.save(results, os.path.join(folder, f"res-{arch}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown: ~20 s per process on a loaded 2-core machine


def _bytes_pass(topo: Any, n: int, rank: int, handed: _Handed) -> dict[str, Any]:
    """Bytes handed to the collectives for one step of the whole gradient (25 MB buckets, the hook's aggregate):
    dense, and hierarchical top-k at each of ``BYTES_RATIOS`` with each payload; by process group."""
    from lightray.comm.hook import CommHook
    from lightray.config import CommConfig

    grads = torch.randn(n, generator=torch.Generator().manual_seed(200 + rank))
    pieces = grads.split(int(BUCKET_MB * 1024 * 1024 / 4))
    out: dict[str, Any] = {}
    runs = [("dense", RATIO, PAYLOAD)]
    runs += [("hierarchical_topk", r, p) for r in BYTES_RATIOS for p in ("compact", "fp32")]
    for mode, ratio, payload in runs:
        hook = CommHook(CommConfig(mode=mode, ratio=ratio, warmup_steps=0, selection=SELECTION, payload=payload),
                        topo, torch.device("cpu"))
        hook.prepare()
        hook._need_agree = False  # the ranks start level: no agreement all-reduce in the count
        handed.names = hook.groups.named() if hook.groups is not None else {}
        g0 = dict(handed.by_group)
        for i, p in enumerate(pieces):
            hook.aggregate(p, [(f"b{i}", p.numel())], bucket_index=i, last=i == len(pieces) - 1)
        out[f"{mode}/{ratio:g}/{payload}" if mode != "dense" else "dense"] = {
            "by_group": {k: v - g0.get(k, 0) for k, v in handed.by_group.items() if v != g0.get(k, 0)},
            "modelled_inter_node": hook.bytes_inter_node}
    return out


def inter_node_bytes_figure(arch: str, n: int, bytes_pass: dict[str, Any], nodes_here: int,
                            per_node_here: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Inter-node bytes per step, dense over hierarchical top-k, at ``BYTES_RATIOS`` and both payloads: modelled
    (lightray.comm.auto) at 16 x 8 for ``arch``, and from the bytes counted here, with the formula written out.
    Returns (figure, goal entry)."""
    fig: dict[str, Any] = {
        "layout": f"{NODES} nodes x {GPUS_PER_NODE} GPUs, {arch} ({n} elements), {BUCKET_MB:g} MB buckets",
        "formula": ("per node link and step: hierarchical dense (reduce-scatter in the node, ring all-reduce across "
                    "nodes, all-gather in the node) 2 (N-1)/N S; flat ring dense 2 (W-1)/W S; hierarchical top-k "
                    "(N-1) B, B = the bytes a node's workers hand the cross-node all-gathers (their chunks cover the "
                    "gradient once). Ratio vs hierarchical dense = 2 S / (N B)"),
        "modelled": {}, "counted": {}}
    cluster = comm_auto.Cluster(NODES, GPUS_PER_NODE, LINK_GBPS)
    dense_total = bytes_pass["dense"]["by_group"].get("world", 0)  # S: each worker hands the whole gradient
    for ratio in BYTES_RATIOS:
        key = f"{ratio:g}"
        fig["modelled"][key], fig["counted"][key] = {}, {}
        for payload in ("compact", "fp32"):
            costs = comm_auto.StepCosts(elements=n, buckets=n_buckets(n), ratio=ratio, compress_s=0.0, payload=payload)
            inter = {m: comm_auto.parts(m, cluster, costs)["inter_bytes"]
                     for m in ("dense", "hierarchical_dense", "hierarchical_topk")}
            fig["modelled"][key][payload] = {
                "hierarchical_dense_over_hierarchical_topk": round(inter["hierarchical_dense"] / inter[
                    "hierarchical_topk"], 2),
                "flat_dense_over_hierarchical_topk": round(inter["dense"] / inter["hierarchical_topk"], 2),
                "hierarchical_topk_inter_node_bytes": int(inter["hierarchical_topk"])}
            rec = bytes_pass.get(f"hierarchical_topk/{key}/{payload}")
            if rec is None or not dense_total:
                continue
            b_node = rec["by_group"].get("cross_node", 0) * per_node_here  # every worker of a node hands the same
            fig["counted"][key][payload] = {
                "dense_bytes_handed_per_worker": dense_total, "cross_node_bytes_handed_per_node": b_node,
                "bytes_per_sent_entry": round(b_node / (ratio * n), 3),
                f"dense_over_hierarchical_topk_at_{nodes_here}_nodes_here": round(
                    2 * dense_total / (nodes_here * b_node), 2),
                f"dense_over_hierarchical_topk_at_{NODES}_nodes": round(2 * dense_total / (NODES * b_node), 2)}
    fig["counted_how"] = (f"bytes handed to the collectives (wrapped) in one step of the whole gradient on "
                          f"{nodes_here} simulated nodes x {per_node_here} gloo workers; B per node and S per worker "
                          f"do not depend on the node count (k = ratio x elements), so the same counts give the "
                          f"{NODES}-node ratio 2 S / ({NODES} B)")
    goal: dict[str, Any] = {"target": f">= {BYTES_GOAL:g}x fewer inter-node bytes than hierarchical dense at "
                                      f"{NODES} nodes x {GPUS_PER_NODE}, compact payload; holds only where the "
                                      f"counted and the modelled figure both reach it"}
    for ratio in BYTES_RATIOS:
        key = f"{ratio:g}"
        counted = fig["counted"].get(key, {}).get("compact", {}).get(f"dense_over_hierarchical_topk_at_{NODES}_nodes")
        modelled = fig["modelled"][key]["compact"]["hierarchical_dense_over_hierarchical_topk"]
        goal[f"ratio_{key}"] = {"counted": counted, "modelled": modelled,
                                "holds": bool(counted is not None and min(counted, modelled) >= BYTES_GOAL)}
    return fig, goal


def inter_node_bytes_16_nodes(fig: dict[str, Any], arch: str) -> dict[str, Any]:
    """The 16-node inter-node bytes of hierarchical top-k at ``RATIO``, compact payload, from the figure above. It is
    scaled by formula from the simulated nodes here, never measured on 16 nodes: labelled ``modelled``."""
    return {"value": fig["modelled"][f"{RATIO:g}"]["compact"]["hierarchical_topk_inter_node_bytes"], "kind": "modelled",
            "what": f"hierarchical top-k inter-node bytes per node link and step, ratio {RATIO:g}, compact payload, "
                    f"{NODES} nodes x {GPUS_PER_NODE} GPUs, {arch}",
            "how": fig["formula"]}


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compress_overhead(batch: int, ratio: float, reps: int = 3, device: torch.device | None = None) -> dict[str, Any]:
    """Seconds of the hook's own compute per step over ResNet-50's gradient buckets, per selection method
    and with/without the DGC units, against a measured ResNet-50 forward + backward on ``device`` (this CPU)."""
    from lightray.comm.compress import k_for, payload_nbytes
    from lightray.comm.topology import Topology

    device = device or torch.device("cpu")
    # The step the compression is set against is the one lightray trains with: channels_last, at the precision
    # lightray's auto picks on this device (an fp32 NCHW step on the GPU understated the share 2-3x).
    from lightray.config import ModelConfig
    from lightray.train.device import precision_for

    bf16 = precision_for(ModelConfig(), device) == "bf16"
    model = _model("resnet50").to(device).to(memory_format=torch.channels_last)
    buckets = _buckets(model, BUCKET_MB)
    x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0)).to(device)
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), generator=torch.Generator().manual_seed(1)).to(device)
    fb = []
    for _ in range(2 if device.type == "cpu" else 4):
        model.zero_grad()
        _sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        _sync(device)
        fb.append(time.perf_counter() - t0)
    grads = {n: p.grad.reshape(-1).clone() for n, p in model.named_parameters()}
    topo = Topology.simulated(2, 0, 1)  # only for the hook's bookkeeping: no collective runs here
    variants = {"exact": {"selection": "exact"}, "sampled": {"selection": "sampled"},
                "sampled_dgc": {"selection": "sampled", "momentum_correction": True, "momentum_masking": True},
                "sampled_dgc_per_layer": {"selection": "sampled", "momentum_correction": True, "momentum_masking": True,
                                          "per_layer": True}}
    elements = sum(n for b in buckets for _, n in b)
    out: dict[str, Any] = {"device": str(device), "batch": batch, "resolution": 224, "payload": PAYLOAD,
                           "threads": torch.get_num_threads(), "forward_backward_s": round(min(fb), 4),
                           "step_as": f"{'bf16 autocast' if bf16 else 'fp32'}, channels_last",
                           "buckets": len(buckets), "elements": elements, "ratio": ratio, "seconds": {},
                           "cast_bf16_s": round(comm_auto.time_cast(elements, torch.bfloat16, device), 5),
                           "cast_fp16_s": round(comm_auto.time_cast(elements, torch.float16, device), 5)}
    flats = [torch.cat([grads[n] for n, _ in b]) for b in buckets]
    for name, kw in variants.items():
        hook = _topk_hook(ratio, topo, device, **kw)

        def flat_topk(hook=hook) -> None:
            for i, (flat, layout) in enumerate(zip(flats, buckets)):
                acc, residual, u = hook.sparse.accumulate(flat, i, layout, flat.numel(), 0, flat.numel(), 1.0)
                segments = [m for _, m in layout] if hook.cfg.per_layer else None
                packed, k = hook.sparse.sparsify(acc, residual, u, segments)
                assert k == sum(k_for(hook.ratio_now, m) for m in segments or [flat.numel()])
                assert packed.numel() * packed.element_size() == payload_nbytes(k, flat.numel(), PAYLOAD)

        best = _best_seconds(flat_topk, reps, device)
        out["seconds"][name] = round(best, 4)
        out[f"frac_{name}"] = round(best / min(fb), 4)
        if name == "sampled":
            out["sampled_selection"] = hook.selection.plain()  # plain ints: some counts stay on the device
    out["hierarchical_topk"] = _hierarchical_overhead(buckets, flats, ratio, reps, device, topo, min(fb))
    return out


def _topk_hook(ratio: float, topo: Any, device: torch.device, **kw: Any) -> Any:
    """A top-k CommHook for timing its compute alone (no process group is used)."""
    from lightray.comm.hook import CommHook
    from lightray.config import CommConfig

    hook = CommHook(CommConfig(mode="topk", ratio=ratio, warmup_steps=0, payload=PAYLOAD, **kw), topo, device)
    hook.optimizer_momentum(0.9)
    return hook


def _best_seconds(work: Callable[[], None], reps: int, device: torch.device) -> float:
    """The fastest of ``reps`` timed calls of ``work``, the device synchronised around each."""
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        work()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _hierarchical_overhead(buckets: list[list[tuple[str, int]]], flats: list[torch.Tensor], ratio: float,
                           reps: int, device: torch.device, topo: Any, step_s: float,
                           node_size: int = GPUS_PER_NODE, nodes: int = NODES) -> dict[str, Any]:
    """Hierarchical top-k's own compute per worker and step, timed on its own path (lightray.comm.hook's
    ``_hierarchical`` without its collectives): the node sum's fp32 copy, the accumulation and top-k over this
    worker's 1/``node_size`` chunk of each bucket, and the scatter-sum of the ``nodes`` nodes' packed chunks."""
    hook = _topk_hook(ratio, topo, device, selection=SELECTION)

    def hierarchical() -> None:
        for i, (flat, layout) in enumerate(zip(flats, buckets)):
            n = flat.numel()
            c = math.ceil(n / node_size)
            node_sum = flat.float().clone()
            acc, residual, u = hook.sparse.accumulate(node_sum[:c], i, layout, n, 0, c, float(node_size))
            packed, k = hook.sparse.sparsify(acc, residual, u)
            hook.sparse.scatter_sum([packed] * nodes, k, c, device).div_(node_size * nodes)

    best = _best_seconds(hierarchical, reps, device)
    return {"seconds": round(best, 4), "frac": round(best / step_s, 4), "node_size": node_size, "nodes": nodes,
            "selection": SELECTION}


def crossover_here(elements: int, workers: int, compress_s: float, cast_s: float, overlap_s: float,
                   compute_s: float) -> dict[str, Any]:
    """Crossover link speed per mode for this machine's layout (2 simulated nodes) and measured compute."""
    cluster = comm_auto.Cluster(2, max(1, workers // 2), 1.0, comm_auto.INTRA_GBPS["cpu"])
    costs = comm_auto.StepCosts(elements=elements, buckets=n_buckets(elements), ratio=RATIO, compress_s=compress_s,
                                cast_s=cast_s, overlap_s=overlap_s, compute_s=compute_s, payload=PAYLOAD)
    modes = [m for m in PROJECTED_MODES if m not in ("dense", "powersgd")]
    return {"gbps": {m: comm_auto.crossover_gbps(m, cluster, costs) for m in modes},
            "inputs": {"cluster": {**asdict(cluster), "link_gbps": "solved for"}, "costs": asdict(costs)}}


# --- accuracy part ---------------------------------------------------------------------------------
DGC_FLAGS = ["--comm.momentum_correction=true", "--comm.momentum_masking=true", "--comm.sparsity_warmup_epochs=2",
             "--comm.selection=sampled", f"--comm.payload={PAYLOAD}"]
ACCURACY_VARIANTS = {
    "dense": [],
    "topk_ef": ["--comm.mode=topk", f"--comm.ratio={RATIO}", *DGC_FLAGS],
    "topk_ef_0001": ["--comm.mode=topk", "--comm.ratio=0.001", *DGC_FLAGS],
}
ACCURACY_DEFAULT = "dense,topk_ef,topk_ef_0001"


def accuracy(storage: str, extra: list[str], epochs: float | None, plain: bool,
             names: list[str] | None = None) -> dict[str, Any]:
    """Demo trainings through ``python app/run.py``, each on its own local Ray cluster, the same seed and budget:
    the ``names`` of ``ACCURACY_VARIANTS`` (default: all), one after the other."""
    from bench.common import REPO

    variants = {k: v for k, v in ACCURACY_VARIANTS.items() if names is None or k in names}
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


def overhead_only(args: argparse.Namespace, machine: Machine, argv: list[str] | None) -> None:
    """The compression's own compute per comm mode at ResNet-50 size on ``--device``, against the training step
    (bf16 channels_last on a GPU): dense costs nothing; fp16 and bf16 one cast of the gradient each; topk the
    hook's selection, packing and error feedback (exact and sampled selection, with and without the DGC units);
    hierarchical_topk its own path over a worker's chunk of a node of ``GPUS_PER_NODE``.
    PowerSGD's compute is not timed here (the projection keeps it at 0: a lower bound)."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.comm --overhead-only: --device cuda but no CUDA device is visible")
    over = compress_overhead(args.overhead_batch, RATIO, reps=args.overhead_reps, device=device)
    sel = over["seconds"][SELECTION]
    # Every mode its own measurement: fp16 and bf16 casts timed each, hierarchical top-k on its own path.
    per_mode = {"dense": 0.0, "fp16": over["cast_fp16_s"], "bf16": over["cast_bf16_s"], "topk": sel,
                "hierarchical_topk": over["hierarchical_topk"]["seconds"], "powersgd": None}
    figures = {"compress_overhead": over, "per_mode_s": per_mode, "selection": SELECTION, "ratio": RATIO,
               "compression_cost_measured_on": device.type,
               "per_mode_frac_of_forward_backward": {m: None if v is None else round(v / over["forward_backward_s"], 4)
                                                     for m, v in per_mode.items()}}
    ratios = {"dgc_over_plain_sampled": round(over["seconds"]["sampled_dgc"] / max(over["seconds"]["sampled"], 1e-9),
                                              3),
              "sampled_over_exact": round(over["seconds"]["sampled"] / max(over["seconds"]["exact"], 1e-9), 3)}
    emit("comm", figures, ratios, machine.finish(argv, backend=f"none (compute only, {device.type})"))


def build_parser() -> argparse.ArgumentParser:
    """The bench's command line."""
    ap = argparse.ArgumentParser(prog="python -m bench.comm", description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=4, help="gloo processes (2..4)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode")
    ap.add_argument("--models", default="resnet18,resnet50")
    ap.add_argument("--accuracy", action="store_true", help="also run the demo trainings (several minutes each)")
    ap.add_argument("--accuracy-plain", action="store_true", help="with --accuracy: also top-k + EF without DGC units")
    ap.add_argument("--epochs", type=float, default=None, help="demo epochs for --accuracy (default: the recipe's)")
    ap.add_argument("--no-accuracy", action="store_true", help="(default) no demo trainings")
    ap.add_argument("--accuracy-variants", default=ACCURACY_DEFAULT,
                    help=f"with --accuracy: which of {', '.join(ACCURACY_VARIANTS)} to run")
    ap.add_argument("--seed", type=int, default=None, help="with --accuracy: scaling.seed of every run")
    ap.add_argument("--overhead-batch", type=int, default=8, help="ResNet-50 batch for the overhead's fwd+bwd")
    ap.add_argument("--storage", default="", help="run folder root for the accuracy part (default: a temp dir)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override for the accuracy runs (e.g. data.train_size=2000)")
    ap.add_argument("--overhead-only", action="store_true",
                    help="only the compression's own compute per mode at ResNet-50 size, on --device (no gloo "
                         "processes, no projection): bench/gpu_suite.sh's step")
    ap.add_argument("--device", default="cpu", help="with --overhead-only: cpu or cuda")
    ap.add_argument("--overhead-reps", type=int, default=3, help="timed passes over the buckets (best is kept)")
    return ap


def _compression_costs(args: argparse.Namespace,
                       figures: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(CPU overhead, the overhead the projection uses, where that one was measured): the compression's own
    compute on this CPU and, when there is one, on the GPU; both go into ``figures``."""
    over = compress_overhead(args.overhead_batch, RATIO, reps=args.overhead_reps)
    figures["compress_overhead"] = over
    figures["compress_overhead_frac"] = over[f"frac_{SELECTION}"]
    src, src_label = over, "measured on this CPU at ResNet-50 size (an upper bound for a GPU), scaled by elements"
    if torch.cuda.is_available():
        gpu = compress_overhead(args.overhead_batch, RATIO, device=torch.device("cuda"))
        figures["compress_overhead_gpu"] = gpu
        figures["compress_overhead_frac_gpu"] = gpu[f"frac_{SELECTION}"]
        src, src_label = gpu, f"measured on {torch.cuda.get_device_name()} at ResNet-50 size, scaled by elements"
    # Where the compression costs that feed the projection and the crossover were measured: until the suite has
    # run on a GPU, a CPU's figure (an upper bound), and every reader of the crossover must see that.
    figures["compression_cost_measured_on"] = "cuda" if src is not over else "cpu"
    return over, src, src_label


def _mode_figures(r: dict[str, Any], dense: dict[str, Any]) -> dict[str, Any]:
    """One measured mode's figures: bytes counted and modelled (and against dense), step, backward, overlap."""
    return {
        "counted_handed_bytes_per_step": int(r["handed_bytes"]),
        "counted_handed_bytes_by_group": {k: int(v) for k, v in r["handed_by_group"].items()},
        "counted_handed_bytes_vs_dense": round(r["handed_bytes"] / dense["handed_bytes"], 5),
        "modelled_wire_bytes_per_step": int(r["bytes"]),
        "modelled_inter_node_bytes_per_step": int(r["inter_bytes"]),
        "modelled_wire_bytes_vs_dense": round(r["bytes"] / dense["bytes"], 5),
        "modelled_inter_node_bytes_vs_dense": round(r["inter_bytes"] / dense["inter_bytes"], 5),
        "step_s": round(r["step_s"], 4), "step_vs_dense": round(r["step_s"] / dense["step_s"], 3),
        "backward_s": round(r["backward_s"], 4), "overlap_frac": r["overlap_frac"],
        "backward_window_share": round(r["window_share"], 4), "buckets_last_step": r["buckets"][-8:],
        "comm_s": None if r["comm_s"] is None else round(r["comm_s"], 4)}


def _mode_ratios(arch: str, mode: str, r: dict[str, Any], dense: dict[str, Any], ratios: dict[str, float]) -> None:
    """Dense over ``mode`` for ``arch``: counted, modelled wire and inter-node bytes, and step time."""
    ratios[f"{arch}_counted_handed_bytes_dense_over_{mode}"] = round(
        dense["handed_bytes"] / max(r["handed_bytes"], 1), 3)
    ratios[f"{arch}_modelled_wire_bytes_dense_over_{mode}"] = round(dense["bytes"] / max(r["bytes"], 1), 3)
    ratios[f"{arch}_modelled_inter_node_bytes_dense_over_{mode}"] = round(
        dense["inter_bytes"] / max(r["inter_bytes"], 1), 3)
    ratios[f"{arch}_step_time_dense_over_{mode}"] = round(dense["step_s"] / r["step_s"], 3)


def _arch_figures(arch: str, args: argparse.Namespace, over: dict[str, Any], src: dict[str, Any], src_label: str,
                  figures: dict[str, Any], ratios: dict[str, float]) -> dict[str, Any]:
    """Measure every mode on ``arch`` with gloo workers, then project to 16 x 8 V100 and solve the crossover
    here; figures and ratios go into ``figures[arch]`` and ``ratios``. Returns the worker's bytes pass."""
    res = measure(arch, args.workers, args.steps)
    dense, n = res["dense"], res["elements"]
    figures[arch] = {"elements": n, "measured": {}}
    for mode in MODES:
        r = res[mode]
        figures[arch]["measured"][mode] = _mode_figures(r, dense)
        if mode != "dense":
            _mode_ratios(arch, mode, r, dense, ratios)
    scale = n / src["elements"]
    proj = project(arch, n, powersgd_elements(_model(arch), 2), src["seconds"][SELECTION] * scale,
                   src["cast_bf16_s"] * scale, dense["window_share"], src_label)
    figures[arch]["projection_16x8_v100_25gbps"] = proj
    for mode in PROJECTED_MODES:
        if mode != "dense":
            ratios[f"{arch}_projected_step_dense_over_{mode}"] = round(
                proj["modes"]["dense"]["step_s"] / proj["modes"][mode]["step_s"], 3)
    cpu_scale = n / over["elements"]
    figures[arch]["crossover_here_gbps"] = crossover_here(
        n, args.workers, over["seconds"][SELECTION] * cpu_scale, over["cast_bf16_s"] * cpu_scale,
        dense["window_share"] * dense["backward_s"], dense["step_s"])
    return res["bytes_pass"]


def _headline(archs: list[str], workers: int, bytes_passes: dict[str, Any], figures: dict[str, Any],
              ratios: dict[str, float]) -> dict[str, Any]:
    """The head model's (ResNet-50 when measured) inter-node bytes figure, crossover and auto pick into
    ``figures``; returns the goals (empty without a model)."""
    goals: dict[str, Any] = {}
    if not archs:
        return goals
    head = "resnet50" if "resnet50" in archs else archs[0]
    per_node = max(1, workers // 2)
    fig, goal = inter_node_bytes_figure(head, figures[head]["elements"], bytes_passes[head],
                                        workers // per_node, per_node)
    figures["inter_node_bytes_dense_over_hierarchical_topk"] = fig
    figures["inter_node_bytes_16_nodes"] = inter_node_bytes_16_nodes(fig, head)
    goals["inter_node_bytes_100x"] = goal
    for key, g in goal.items():
        if isinstance(g, dict) and g.get("counted") is not None:
            ratios[f"inter_node_bytes_dense_over_hierarchical_topk_{key}_compact"] = g["counted"]
    proj = figures[head]["projection_16x8_v100_25gbps"]
    figures["crossover_gbps"] = {m: r["crossover_gbps"] for m, r in proj["modes"].items() if m != "dense"}
    figures["crossover_gbps_for"] = (f"{head}, {NODES} nodes x {GPUS_PER_NODE} V100, modelled "
                                     f"({figures[head]['projection_16x8_v100_25gbps']['model']}); inputs under "
                                     f"{head}.projection_16x8_v100_25gbps.inputs; None: never faster than dense; "
                                     f"compression costs measured on "
                                     f"{figures['compression_cost_measured_on']}"
                                     + (" (an upper bound for a GPU)"
                                        if figures["compression_cost_measured_on"] == "cpu" else ""))
    figures["auto_mode"] = {"picks_at_25gbps": proj["auto_picks"], "why": proj["auto_why"]}
    return goals


def _accuracy_part(ap: argparse.ArgumentParser, args: argparse.Namespace, figures: dict[str, Any],
                   ratios: dict[str, float]) -> None:
    """With ``--accuracy``, the demo trainings and top-1 over dense; else a note that they did not run."""
    if not args.accuracy:
        figures["accuracy_demo"] = "not run (pass --accuracy): ratios.top1_topk_ef_over_dense is absent"
        return
    storage = args.storage or tempfile.mkdtemp(prefix="bench-comm-")
    names = [v.strip() for v in args.accuracy_variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in ACCURACY_VARIANTS]
    if unknown:
        ap.error(f"--accuracy-variants: bad value {unknown[0]!r}; allowed: {', '.join(ACCURACY_VARIANTS)}")
    extra = [f"--{kv}" for kv in args.set] + ([f"--scaling.seed={args.seed}"] if args.seed is not None else [])
    acc = accuracy(storage, extra, args.epochs, args.accuracy_plain, names)
    figures["accuracy_demo"] = acc
    d = acc.get("dense", {}).get("final_top1")
    for name in ("topk_ef", "topk_ef_0001", "topk_ef_plain"):
        e = acc.get(name, {}).get("final_top1")
        if d and e:
            ratios[f"top1_{name}_over_dense"] = round(e / d, 4)


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    machine = Machine()
    if args.overhead_only:
        overhead_only(args, machine, argv)
        return
    if not 2 <= args.workers <= 4:
        ap.error(f"--workers: bad value {args.workers}; expected 2..4")
    figures: dict[str, Any] = {"ratio": RATIO, "workers": args.workers, "bucket_mb": BUCKET_MB,
                               "selection": SELECTION}
    ratios: dict[str, float] = {}
    over, src, src_label = _compression_costs(args, figures)
    archs = [a.strip() for a in args.models.split(",") if a.strip()]
    bytes_passes: dict[str, Any] = {}
    for arch in archs:
        bytes_passes[arch] = _arch_figures(arch, args, over, src, src_label, figures, ratios)
    figures["goals"] = _headline(archs, args.workers, bytes_passes, figures, ratios)
    _accuracy_part(ap, args, figures, ratios)
    emit("comm", figures, ratios, machine.finish(argv, backend="gloo (CPU)"))


if __name__ == "__main__":
    main()
