"""Host time per step: lightray's training step against a plain DDP step, on a model whose compute is negligible,
so that the difference is lightray's own host work per step, broken down by part.

    python -m bench.host_time                 # 5 interleaved pairs, 300 timed steps each after 50 warm-up steps
    python -m bench.host_time --quick         # a correctness run of a few seconds

Both sides run in this process on one rank (a gloo group of one in a HashStore: DDP still fills its buckets and
calls its all-reduce or its comm hook), with one torch thread, the same network (the demo recipe's resnet_tiny,
its widths cut to ``--widths`` so that the arithmetic is a small share of the step), the same pre-made uint8
NHWC batches of ``--batch`` images at ``--resolution`` px, cycled, and the same number of steps.

(a) plain: what a skilled user writes: ``DistributedDataParallel`` (DDP's built-in all-reduce), one
    ``torch.optim.SGD`` with the recipe's momentum, nesterov and weight decay, cross-entropy with its label
    smoothing, the batch normalised on the host as lightray does, and the loss read (a host sync) only at the
    report steps (every ``--report-every`` steps).
(b) lightray: the real ``lightray.train.trainer.Trainer`` built from the demo recipe (``comm.mode``, the
    schedule, clipping, EMA, head warm-up as the recipe sets them), its real ``run_epoch`` fed through the real
    ``DevicePrefetcher``, with a ``LocalContext`` and its records written to a file in this process (a worker
    group sends them to the run's log actor instead: that call is not in this figure).

Per step is the mean time between the starts of consecutive steps, over the steps after the warm-up, the
slowest 5% left out on both sides (time slices taken by other processes): it includes each side's report
steps, amortised. ``ratios.added_ms_per_step`` is lightray's per-step time minus plain's,
one value per interleaved pair (the order alternates), with its spread; ``resolved`` is false when the pairs'
spread is wider than the figure itself. The parts (``figures.parts_ms_per_step``) are the time spent inside the
trainer's own calls, taken by wrapping them with timers for the timed steps: the schedule, the comm hook (host
time up to its future, the all-reduce's launch included), the prefetch hand-over, the inputs' conversion, the
clipping and scaler calls, the report steps (metrics and the record), and the checkpoint checks with the
agreement collective. ``figures.parts_beyond_plain_ms_per_step`` adds up the parts plain has no counterpart
of (all but ``inputs``, which plain does too); what the added time holds beyond them (the step's own Python,
its counters, any difference in the shared arithmetic) is ``figures.added_beyond_parts_ms_per_step``. The timers'
own cost (two clock reads per wrapped call, about a dozen calls a step) is inside lightray's figure: a few
microseconds a step. A host sync outside the report steps is not measurable on a CPU; the GPU
suite's ``sync`` step runs the trainer under CUDA's sync-debug mode for that.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

import numpy as np
import torch

from bench.common import Machine, emit, note, pin_threads, resolved_ratio, spread

# The trainer's own calls, each wrapped by a timer (the part it counts under): methods of the trainer or of
# the objects it holds, and the module-level functions trainer.py calls by name.
PARTS = {
    "schedule": ("sched.lr_at", "sched.momentum_at", "comm.begin_step", "comm.optimizer_momentum",
                 "module:set_lr_momentum"),
    "prefetch_handover": ("_next_batch",),
    "inputs": ("_micro_inputs",),
    "clip_scaler_ema": ("module:clip_gradients", "scaler.step", "scaler.update", "head_warmup.before_step"),
    "report_steps": ("_report_window",),
    "checkpoint_checks_and_agreement": ("_maybe_checkpoint",),
    "sample_log": ("_log_samples",),
}


def build_config(args: argparse.Namespace, storage: str):
    from lightray.config import load_config

    steps = args.warmup + args.steps + 1  # the epoch's last step only ends the timed range
    return load_config("demo", {
        "name": "host-time", "storage": storage, "model.widths": args.widths,
        "schedule.epochs": 1, "schedule.warmup_epochs": 0.0, "schedule.eval_resolution": args.resolution,
        "schedule.phases": [{"until_epoch": 1, "resolution": args.resolution, "batch_size": args.batch,
                             "min_scale": 1.0}],
        "scaling.workers": "1", "report.every_steps": args.report_every, "checkpoint.every_steps": 0,
        "data.demo_classes": args.classes,
    }), steps


def make_batches(args: argparse.Namespace, pool: int = 16) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    n = args.batch
    return [{"image": rng.integers(0, 256, (n, args.resolution, args.resolution, 3), dtype=np.uint8),
             "label": rng.integers(0, args.classes, n).astype(np.int64),
             "sample_id": np.arange(i * n, (i + 1) * n, dtype=np.int64),
             "epoch": np.zeros(n, dtype=np.int64)} for i in range(pool)]


def per_step_ms(starts: list[float], warmup: int, trim: float = 0.05) -> float:
    """Mean time between step starts over the steps after the warm-up, report steps included, without the
    slowest ``trim`` of them: on a shared 2-core machine those are another process's time slices, not the step's
    (report steps, one in ``--report-every``, are far more than 5% of the steps and stay in)."""
    gaps = sorted(np.diff(starts[warmup:]))
    kept = gaps[: max(1, int(len(gaps) * (1 - trim)))]
    return 1000 * float(np.mean(kept))


# --- (a) plain DDP ------------------------------------------------------------------------------------------
def run_plain(cfg, batches: list[dict[str, np.ndarray]], steps: int, report_every: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightray.train.device import IMAGENET_MEAN, IMAGENET_STD, autocast, precision_for
    from lightray.train.model import build_model

    cpu = torch.device("cpu")
    precision = precision_for(cfg.model, cpu)  # lightray's own choice for this CPU: like with like
    torch.manual_seed(cfg.scaling.seed)
    model = build_model(cfg.model, cfg.data.demo_classes).to(memory_format=torch.channels_last)
    ddp = DDP(model)
    phase = cfg.schedule.phases[0]
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr_per_256 * phase.batch_size / 256,
                          momentum=cfg.optim.momentum, nesterov=cfg.optim.nesterov,
                          weight_decay=cfg.optim.weight_decay)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=cfg.optim.label_smoothing)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255
    starts, losses = [], []
    for step in range(steps):
        starts.append(time.perf_counter())
        b = batches[step % len(batches)]
        x = torch.from_numpy(b["image"]).permute(0, 3, 1, 2).float().sub_(mean).div_(std)
        x = x.contiguous(memory_format=torch.channels_last)
        with autocast(precision, cpu):
            loss = loss_fn(ddp(x), torch.from_numpy(b["label"]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % report_every == 0:
            losses.append(float(loss.detach()))  # the log line a user prints: the one host read
    return {"starts": starts, "losses": losses}


# --- (b) lightray's Trainer ---------------------------------------------------------------------------------
class _Timers:
    """Cumulative seconds inside wrapped calls, counted only while ``on``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False

    def wrap(self, part: str, fn):
        @functools.wraps(fn)
        def timed(*a, **kw):
            if not self.on:
                return fn(*a, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[part] += time.perf_counter() - t0
                self.calls[part] += 1
        return timed


def _install_timers(trainer, timers: _Timers) -> list[tuple[Any, str, Any]]:
    """Wrap each call of PARTS; returns what to put back (module-level functions are shared by later runs)."""
    import lightray.train.trainer as trainer_module

    undo = []
    for part, names in PARTS.items():
        for name in names:
            if name.startswith("module:"):
                owner, attr = trainer_module, name.removeprefix("module:")
                undo.append((owner, attr, getattr(owner, attr)))
            else:
                *path, attr = name.split(".")
                owner = functools.reduce(getattr, path, trainer)
            setattr(owner, attr, timers.wrap(part, getattr(owner, attr)))
    return undo


def run_lightray(cfg, batches: list[dict[str, np.ndarray]], steps: int, warmup: int, folder: str) -> dict[str, Any]:
    from lightray.data.spec import IngestSpec, PhaseSpec, TierShards
    from lightray.report.runlog import RunLogWriter
    from lightray.train.context import LocalContext
    from lightray.train.prefetch import DevicePrefetcher
    from lightray.train.trainer import Trainer

    phase = cfg.schedule.phases[0]
    none = TierShards(tier=phase.resolution, fmt="raw", uris=[], sha256=[], rows=[])
    spec = IngestSpec(seed=cfg.scaling.seed, local_dir=folder, train_size=steps * phase.batch_size,
                      phases=[PhaseSpec(0, phase.resolution, phase.batch_size, 1.0, 0, 1, none)], val=none,
                      eval_resolution=phase.resolution, val_crop_ratio=1.0)
    writer = RunLogWriter(folder)
    trainer = Trainer(cfg, spec, folder, cfg.data.demo_classes, rank=0, world=1,
                      ctx=LocalContext(folder, {}, keep=1), report=writer.log)
    timers = _Timers()
    undo = _install_timers(trainer, timers)
    starts: list[float] = []
    step_fn = trainer.train_step

    hook_s: list[float] = []  # the hook's own clock (perf_counter around every bucket) at the timed starts

    def marked_step(batch, run):
        starts.append(time.perf_counter())
        if len(starts) in (warmup + 1, steps):
            hook_s.append(trainer.comm.comm_seconds)
        timers.on = warmup < len(starts) < steps  # the steps between the first and the last timed start
        return step_fn(batch, run)

    trainer.train_step = marked_step
    run = trainer.phase_run(0)
    feed = DevicePrefetcher(iter(batches[i % len(batches)] for i in range(steps)), trainer.device,
                            enabled=cfg.scaling.device_prefetch)
    try:
        trainer.run_epoch(0, 0, run, feed)
    finally:
        feed.close()
        for owner, attr, fn in undo:
            setattr(owner, attr, fn)
        writer.flush()
    timed = steps - 1 - warmup
    parts = {k: 1000 * v / timed for k, v in timers.seconds.items()}
    parts["comm_hook"] = 1000 * (hook_s[1] - hook_s[0]) / timed
    return {"starts": starts, "parts_ms": parts, "calls": dict(timers.calls), "comm_mode": trainer.comm.mode}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--steps", type=int, default=300, help="timed steps per side and pair")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--resolution", type=int, default=16)
    p.add_argument("--widths", type=int, nargs=3, default=[4, 8, 8])
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--report-every", type=int, default=5, help="the demo recipe's report.every_steps")
    p.add_argument("--quick", action="store_true", help="2 pairs of 40 steps: a correctness run")
    args = p.parse_args(argv)
    if args.quick:
        args.pairs, args.steps, args.warmup = 2, 40, 10
    for name in ("pairs", "steps", "warmup", "batch", "resolution", "classes", "report_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: bad value {getattr(args, name)}; expected at least 1")
    return args


def measure_pairs(args: argparse.Namespace) -> dict[str, Any]:
    """The interleaved pairs: each side's ms per step, lightray's parts, and what its last run reported."""
    batches = make_batches(args)
    out: dict[str, Any] = {"plain": [], "lightray": [], "parts": defaultdict(list), "comm_mode": None, "calls": {}}
    with tempfile.TemporaryDirectory(prefix="lightray-host-time-") as tmp:
        for pair in range(args.pairs):
            cfg, steps = build_config(args, f"{tmp}/runs")
            got = {}
            for side in ("plain", "lightray") if pair % 2 == 0 else ("lightray", "plain"):
                if side == "plain":
                    got[side] = per_step_ms(run_plain(cfg, batches, steps, args.report_every)["starts"], args.warmup)
                    continue
                res = run_lightray(cfg, batches, steps, args.warmup, f"{tmp}/runs/pair{pair}")
                got[side] = per_step_ms(res["starts"], args.warmup)
                out["comm_mode"], out["calls"] = res["comm_mode"], res["calls"]
                for k, v in res["parts_ms"].items():
                    out["parts"][k].append(v)
            out["plain"].append(got["plain"])
            out["lightray"].append(got["lightray"])
            note(f"pair {pair + 1}/{args.pairs}: plain {got['plain']:.3f} ms/step, lightray "
                 f"{got['lightray']:.3f} ms/step, added {got['lightray'] - got['plain']:+.3f} ms")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    machine = Machine()
    threads = pin_threads(1)
    import torch.distributed as dist

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
    try:
        got = measure_pairs(args)
    finally:
        if own_group:
            dist.destroy_process_group()
    plain_ms, lightray_ms, parts = got["plain"], got["lightray"], got["parts"]
    added = [q - p for p, q in zip(plain_ms, lightray_ms)]
    add = spread(added, 4)
    beyond = [sum(v[i] for k, v in parts.items() if k != "inputs") for i in range(len(added))]
    rest = [a - b for a, b in zip(added, beyond)]
    width = None if add["max"] is None else round(add["max"] - add["min"], 4)
    figures = {
        "plain_ms_per_step": spread(plain_ms, 4), "lightray_ms_per_step": spread(lightray_ms, 4),
        "parts_ms_per_step": {k: spread(v, 4) for k, v in sorted(parts.items())},
        "parts_beyond_plain_ms_per_step": spread(beyond, 4), "added_beyond_parts_ms_per_step": spread(rest, 4),
        "calls_in_timed_steps": got["calls"], "comm_mode": got["comm_mode"], "torch_threads": threads,
        "steps": args.steps, "warmup": args.warmup, "batch": args.batch, "resolution": args.resolution,
        "widths": args.widths, "report_every": args.report_every, "goal_added_ms": 0.5,
    }
    ratios = {
        "added_ms_per_step": {**add, "spread": width,
                              "resolved": bool(add["n"] >= 2 and width is not None and width <= abs(add["median"]))},
        "lightray_over_plain_steps_per_s": resolved_ratio([p / q for p, q in zip(plain_ms, lightray_ms)]),
        "plain_step_ms_median": round(statistics.median(plain_ms), 4),
    }
    return emit("host_time", figures, ratios, machine.finish(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
