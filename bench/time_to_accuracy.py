"""Time to the same top-1 on the demo dataset: the PyTorch ImageNet example recipe against lightray's demo.

    python -m bench.time_to_accuracy                       # targets 0.5 and 0.8 (the demo recipe's), 16 epochs
    python -m bench.time_to_accuracy --target 0.7 --baseline-epochs 16
    python -m bench.time_to_accuracy --quick               # tiny data, 1 epoch each: checks the bench works

Same data (``app.data.demo.ensure_demo`` with the demo recipe's data settings, made once before either
side runs and not timed), same model architecture (``build_model``, resnet_tiny), same machine, run one
after the other in this process (lightray first), each evaluated on the whole validation split after every epoch.

(a) baseline: what pytorch/examples ``imagenet/main.py`` does, scaled to 64 px: torchvision
    ``ImageFolder`` over the JPEG tree + ``DataLoader`` (``num_workers`` = cores, shuffle, not persistent),
    train ``RandomResizedCrop(64)`` + ``RandomHorizontalFlip``, val ``Resize(73)`` + ``CenterCrop(64)``, fixed
    batch 128, ``SGD`` momentum 0.9, lr 0.1 x 128/256, weight decay 1e-4 on every parameter, ``StepLR``
    dividing the LR by 10 every 30% of the epochs, plain cross-entropy, NCHW, default init (no zero-init
    residual), no warm-up, no label smoothing. It runs until the highest target or ``--baseline-epochs``
    (default 16: the demo recipe's epoch budget, so both sides get the same number of passes over the data).
    Single process (torch's default threads = cores) rather than 2-process gloo DDP: on a 2-core machine
    the two DDP ranks plus their loader workers would only share the same two cores, and gloo all-reduce
    adds cost that no second device pays back; the example's own default without ``--multiprocessing-
    distributed`` is one process too.
(b) lightray: ``run_training(load_config("demo", overrides))`` -- the demo recipe as shipped (2 workers,
    progressive resizing 32 -> 48 -> 64, its schedule and epochs); overrides only set the storage, run
    name, a fresh local Ray cluster and ``report.targets``. It runs its whole schedule (the app has no
    stop-at-target); time to target is read from its metrics.

Figures: per side the training seconds to the target (from the first training step; lightray's
``elapsed_s``, which includes its per-epoch validation and checkpoints, as the baseline's includes its
validation), the wall seconds to the target including start-up (Ray start, shard-cache check or build,
worker-group start for lightray; dataset scan and model build for the baseline), the total wall, the
epochs to the target and the best top-1, and each side's training seconds per epoch. Ratios: baseline
seconds over lightray seconds (bigger = lightray faster), for training time and for wall time including
start-up; ``null`` when a side missed the target. ``baseline_over_lightray_train_s_per_epoch`` compares
the cost of one pass over the data (not at equal accuracy: lightray's early epochs run at 32/48 px).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

from bench.common import Machine, emit, load_avg, note, ratio, read_jsonl

DEFAULT_STORAGE = os.path.join(os.environ.get("TMPDIR", "/tmp"), "lightray-bench-tta")


def quick_overrides() -> dict[str, Any]:
    """Tiny data and one short epoch: a correctness run of the bench, not a measurement."""
    return {"data.demo_train_per_class": 12, "data.demo_val_per_class": 6, "schedule.epochs": 1,
            "schedule.phases": [{"until_epoch": 1, "resolution": 32, "batch_size": 32, "min_scale": 0.35}],
            "data.autotune_seconds": 0.0}


def demo_tree(storage: str, overrides: dict[str, Any]) -> str:
    """The demo ImageFolder tree lightray's prepare will use (same path, so it is made only once)."""
    from app.config import load_config
    from app.data.demo import ensure_demo
    from app.data.prepare import resolve_cache_root

    cfg = load_config("demo", {"storage": storage, **overrides})
    root = resolve_cache_root(cfg)
    os.makedirs(root, exist_ok=True)
    return ensure_demo(root, cfg.data)


def _to_targets(history: list[dict[str, Any]], targets: list[float], train_key: str, wall_key: str
                ) -> dict[str, Any]:
    """Per target: the first epoch record at or above it (training s, wall s incl. start-up, epochs)."""
    out: dict[str, Any] = {}
    for t in targets:
        hit = next((r for r in history if float(r["val_top1"]) >= t), None)
        out[f"{t:g}"] = {"reached": hit is not None, "train_s_to_target": float(hit[train_key]) if hit else None,
                         "wall_s_to_target": float(hit[wall_key]) if hit else None,
                         "epochs_to_target": int(hit["epoch"]) if hit else None}
    return {"by_target": out, **out[f"{max(targets):g}"]}


# --- (a) the PyTorch ImageNet example recipe --------------------------------------------------------
def run_baseline(tree: str, *, epochs: int, targets: list[float], batch: int, resolution: int, workers: int,
                 weight_decay: float, classes_expected: int) -> dict[str, Any]:
    import torchvision.transforms as T
    from torch import nn
    from torchvision.datasets import ImageFolder

    from app.config import ModelConfig
    from app.train.device import IMAGENET_MEAN, IMAGENET_STD
    from app.train.model import build_model

    t_start = time.perf_counter()
    normalize = T.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD)
    train_set = ImageFolder(os.path.join(tree, "train"), T.Compose(
        [T.RandomResizedCrop(resolution), T.RandomHorizontalFlip(), T.ToTensor(), normalize]))
    val_set = ImageFolder(os.path.join(tree, "val"), T.Compose(
        [T.Resize(round(resolution / 0.875)), T.CenterCrop(resolution), T.ToTensor(), normalize]))
    if len(train_set.classes) != classes_expected:
        raise RuntimeError(f"demo tree {tree}: {len(train_set.classes)} classes, expected {classes_expected}")
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=batch, shuffle=True, num_workers=workers)
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=batch, shuffle=False, num_workers=workers)
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch="resnet_tiny", zero_init_residual=False, channels_last=False),
                        len(train_set.classes))
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * batch / 256, momentum=0.9, weight_decay=weight_decay)
    step_every = max(1, round(0.3 * epochs))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=step_every, gamma=0.1)
    history = []
    t_train = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        loss_sum, n = 0.0, 0
        for x, y in train_loader:
            loss = criterion(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_sum += float(loss.detach()) * len(y)
            n += len(y)
        sched.step()
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in val_loader:
                correct += int((model(x).argmax(1) == y).sum())
                total += len(y)
        now = time.perf_counter()
        rec = {"epoch": epoch + 1, "train_loss": loss_sum / max(1, n), "val_top1": correct / max(1, total),
               "train_s": now - t_train, "wall_s": now - t_start}
        history.append(rec)
        note(f"baseline epoch {epoch + 1}/{epochs}: loss {rec['train_loss']:.3f} top-1 {rec['val_top1']:.3f} "
             f"({rec['train_s']:.0f} s)")
        if rec["val_top1"] >= max(targets):
            break
    return {**_to_targets(history, targets, "train_s", "wall_s"), "epochs_run": len(history),
            "best_top1": max(r["val_top1"] for r in history), "train_s_total": history[-1]["train_s"],
            "total_wall_s": time.perf_counter() - t_start, "train_images": len(train_set),
            "val_images": len(val_set), "lr_step_every_epochs": step_every,
            "top1_per_epoch": [round(r["val_top1"], 4) for r in history]}


# --- (b) lightray's demo recipe ---------------------------------------------------------------------
def run_lightray(storage: str, overrides: dict[str, Any], targets: list[float]) -> dict[str, Any]:
    import ray

    from app.config import load_config
    from app.train.runner import run_training

    name = f"tta-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    cfg = load_config("demo", {"storage": storage, "name": name, "scaling.ray_address": "local",
                               "report.targets": list(targets), **overrides})
    t0_unix, t0 = time.time(), time.perf_counter()
    try:
        summary = run_training(cfg, progress=False, stream=sys.stderr)
    finally:
        ray.shutdown()
    total = time.perf_counter() - t0
    vals = [r for r in read_jsonl(os.path.join(storage, name, "metrics.jsonl")) if "val_top1" in r]
    if not vals:
        raise RuntimeError(f"lightray run {storage}/{name}: no validation records in metrics.jsonl")
    for r in vals:
        r["wall_s"] = float(r["time"]) - t0_unix
    return {**_to_targets(vals, targets, "elapsed_s", "wall_s"), "epochs_run": int(vals[-1]["epoch"]),
            "best_top1": max(float(r["val_top1"]) for r in vals), "total_wall_s": total,
            "train_s_total": float(vals[-1]["elapsed_s"]), "workers": cfg.worker_range()[1],
            "summary_time_to_target_s": summary.get("time_to_target_s"),
            "top1_per_epoch": [round(float(r["val_top1"]), 4) for r in vals], "run_dir": os.path.join(storage, name)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", type=float, nargs="+", default=[0.5, 0.8],
                   help="top-1 targets; the highest is the headline figure and ends the baseline")
    p.add_argument("--baseline-epochs", type=int, default=16, help="cap (and LR-step horizon) of the baseline")
    p.add_argument("--batch", type=int, default=128, help="baseline batch")
    p.add_argument("--weight-decay", type=float, default=1e-4, help="baseline weight decay (the example's)")
    p.add_argument("--storage", default=DEFAULT_STORAGE,
                   help="lightray storage; its cache/ holds the demo tree and shard cache, kept between runs")
    p.add_argument("--quick", action="store_true", help="tiny data, 1 epoch per side: a correctness run")
    args = p.parse_args(argv)
    for t in args.target:
        if not 0 < t <= 1:
            p.error(f"--target={t}: expected a top-1 fraction in (0, 1]")
    if args.baseline_epochs < 1 or args.batch < 1:
        p.error("--baseline-epochs and --batch: expected positive integers")
    overrides = quick_overrides() if args.quick else {}
    if args.quick:
        args.baseline_epochs, args.batch = 1, 32

    from app.config import load_config

    demo_cfg = load_config("demo", overrides)
    resolution = demo_cfg.schedule.eval_resolution or demo_cfg.schedule.phases[-1].resolution
    machine = Machine()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    t = time.perf_counter()
    tree = demo_tree(args.storage, overrides)
    demo_s = time.perf_counter() - t
    note(f"demo tree {tree} ready ({demo_s:.1f} s); lightray demo recipe first (its figure is the one the "
         "baseline is measured against; the baseline then stops at the target or its cap)")
    loads = {"lightray_load_1m_at_start": load_avg()}
    light = run_lightray(args.storage, overrides, args.target)
    loads["baseline_load_1m_at_start"] = load_avg()
    note(f"lightray: reached={light['reached']} in {light['train_s_to_target']} s; top-1 per epoch "
         f"{light['top1_per_epoch']}; baseline: ImageFolder + DataLoader({cores} workers)")
    base = run_baseline(tree, epochs=args.baseline_epochs, targets=args.target, batch=args.batch,
                        resolution=resolution, workers=cores, weight_decay=args.weight_decay,
                        classes_expected=demo_cfg.data.demo_classes)
    loads["baseline_load_1m_at_end"] = load_avg()
    note(f"baseline: reached={base['reached']} in {base['train_s_to_target']} s")

    def r2(v: float | None) -> float | None:
        return None if v is None else round(v, 2)

    head = max(args.target)
    figures: dict[str, Any] = {"target_top1": head, "targets": args.target, "model": "resnet_tiny",
                               "resolution": resolution, "demo_tree_s": round(demo_s, 1),
                               "train_images": base["train_images"], "val_images": base["val_images"]}
    for side, res in (("baseline", base), ("lightray", light)):
        for key in ("reached", "epochs_to_target", "epochs_run"):
            figures[f"{side}_{key}"] = res[key]
        for key in ("train_s_to_target", "wall_s_to_target", "total_wall_s"):
            figures[f"{side}_{key}"] = r2(res[key])
        figures[f"{side}_best_top1"] = round(res["best_top1"], 4)
        figures[f"{side}_top1_per_epoch"] = res["top1_per_epoch"]
        figures[f"{side}_by_target"] = {k: {kk: r2(vv) if isinstance(vv, float) else vv for kk, vv in v.items()}
                                        for k, v in res["by_target"].items()}
    figures.update(baseline_batch=args.batch, baseline_epochs_cap=args.baseline_epochs,
                   baseline_lr_step_every_epochs=base["lr_step_every_epochs"], baseline_loader_workers=cores,
                   baseline_processes=1, lightray_workers=light["workers"],
                   baseline_train_s_total=r2(base["train_s_total"]), lightray_train_s_total=r2(light["train_s_total"]),
                   lightray_run_dir=light["run_dir"])
    ratios = {"baseline_over_lightray_train_s_to_target": ratio(base["train_s_to_target"],
                                                                light["train_s_to_target"]),
              "baseline_over_lightray_wall_s_to_target": ratio(base["wall_s_to_target"], light["wall_s_to_target"])}
    # Not the same accuracy (lightray's early epochs are at 32/48 px): cost of a pass over the data, for
    # runs where a side misses the target and the ratios above are null.
    ratios["baseline_over_lightray_train_s_per_epoch"] = ratio(base["train_s_total"] / base["epochs_run"],
                                                               light["train_s_total"] / light["epochs_run"])
    if light["reached"] and not base["reached"]:  # the baseline's whole run is a floor on its time to target
        ratios["baseline_over_lightray_train_s_to_target_at_least"] = ratio(base["train_s_total"],
                                                                            light["train_s_to_target"])
        ratios["baseline_over_lightray_wall_s_to_target_at_least"] = ratio(base["total_wall_s"],
                                                                           light["wall_s_to_target"])
    for t in args.target:  # every target's own ratio (the headline one repeats the two above)
        b, lt = base["by_target"][f"{t:g}"], light["by_target"][f"{t:g}"]
        ratios[f"baseline_over_lightray_train_s_to_{t:g}"] = ratio(b["train_s_to_target"], lt["train_s_to_target"])
    emit("time_to_accuracy", figures, ratios, machine.finish(quick=args.quick, **loads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
