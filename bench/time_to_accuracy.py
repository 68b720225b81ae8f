"""Time to the same top-1: lightray's recipe against the same recipe in plain PyTorch, on the demo dataset or on
CIFAR-10's real photos (``--dataset cifar10``, at the end of this text).

    python -m bench.time_to_accuracy                       # targets 0.5 and 0.8, the recipe's 16 epochs, 3 repeats
    python -m bench.time_to_accuracy --repeats 1 --no-example
    python -m bench.time_to_accuracy --quick               # 4 classes, 1,200 images, 8 epochs: checks it works
    python -m bench.time_to_accuracy --quick --example-epochs 2   # the smallest check (the test's)

Same data (``lightray.data.demo.ensure_demo`` with the recipe's data settings, made once before any side runs and
not timed), same model (``build_model`` with the recipe's model section: resnet_tiny, channels_last), same
machine, the sides run one after the other in this process, each evaluated on the whole validation split
after every epoch. The recipe is read from ``app/recipes/demo.yaml`` (through ``load_config``), never copied.

(a) ``plain_same_recipe`` (the primary baseline, ``bench/plain_recipe.py``): the whole recipe, progressive
    phases included, in one plain PyTorch process over a copy of the tree resized once to each phase's size
    and held decoded in memory (``plain_recipe.load_tree``; its one-off decode counts as start-up, as
    prepare counts as lightray's), crops batched in torch, the run's optimiser, LR and momentum curves by
    samples seen. Ratios ``ratios.vs_plain_same_recipe_{train,wall}_s.<target>``.
(a') ``tuned_plain`` (the fixed-resolution baseline): the recipe's hyper-parameters in a plain PyTorch loop,
    at the recipe's final phase (its resolution, batch and crop scale; no progressive resizing, which is part of
    what lightray adds). torchvision ``ImageFolder`` over the JPEG tree + ``DataLoader`` (shuffle, drop_last,
    persistent workers), train ``RandomResizedCrop(res, scale=(min_scale, 1))`` + ``RandomHorizontalFlip``,
    val ``Resize(res / val_crop_ratio)`` + ``CenterCrop(res)`` at the recipe's eval resolution; ``SGD`` with
    the recipe's momentum and Nesterov, LR ``lr_per_256 x batch / 256``, per-step warm-up and decay with the
    recipe's shape (``lightray.schedule.Schedule.lr_shape``: the curve lightray applies, evaluated from the
    recipe), weight decay only on conv/linear weights unless the recipe decays BN and biases too, the
    recipe's label smoothing, channels_last as the recipe. Threads and loader workers are set for the machine
    (``--plain-threads``, ``--plain-loader-workers``; default: the cores). It stops at the highest target or
    the recipe's epochs.
(b) ``pytorch_example`` (the third baseline): pytorch/examples ``imagenet/main.py`` scaled to the final
    resolution: ``RandomResizedCrop(res)`` (scale 0.08-1), fixed batch 128, SGD momentum 0.9, weight decay 1e-4
    on every parameter, ``StepLR`` /10 every 30% of the epochs, plain cross-entropy, no warm-up, NCHW. Its
    LR is chosen by a small sweep (``--example-lr-per-256``, three values by default, the example's own 0.1
    among them): in the first repeat every value runs; the one that reaches the highest target soonest
    (else the best top-1) is used in later repeats; every sweep run is reported. ``--no-example`` skips it;
    ``--example-epochs N`` caps its epochs (default: the recipe's; its LR steps keep falling at 30% of them),
    which makes the sweep, three whole runs, cheap enough for a correctness check.
(c) ``lightray``: ``run_training(load_config("demo", overrides))``: the recipe as shipped (2 workers,
    progressive resizing, its schedule and epochs); overrides only set storage, run name, seed, a fresh local
    Ray cluster and ``report.targets``. It runs its whole schedule; time to target is read from its metrics.

Times per side and target: ``train_s_to_target`` from the first training step (lightray's ``elapsed_s``; the
baselines' clock starts when their training loop starts, loader workers' start included, and includes their
per-epoch validation as lightray's does), ``wall_s_to_target`` including start-up, and ``startup_s`` apart:
dataset scan, model and loader build for the baselines; Ray start, shard-cache check or build and
worker-group start for lightray (the wall time before its first training step).

``--repeats N`` (default 3; 1 with ``--quick``) runs every side N times, reversing the order of lightray and
the two recipe baselines every other repeat, each repeat with its own seed. Every figure is given as median,
min, max and the runs (``bench.common.spread``). Ratios are baseline seconds over lightray seconds (bigger =
lightray faster), computed per repeat and then summarised: ``ratios.vs_plain_same_recipe_{train,wall}_s.<target>``,
``ratios.vs_tuned_plain_{train,wall}_s.<target>`` and ``ratios.vs_pytorch_example_{train,wall}_s.<target>``; a
repeat in which a side missed the target counts as ``missing``; ``resolved`` is false when the repeats' spread
is wider than the median's distance from 1, and always with one repeat.

``--dataset cifar10`` (``--data``: the training split as Parquet, default ``../shared/data/cifar10``): the
``cifar10`` recipe, validated on its seeded hold-out of the training split. The primary baseline is
``plain_same_recipe`` (``bench/plain_recipe.py``): the whole recipe, progressive phases included, in one plain
PyTorch process over the photos decoded once into uint8 arrays in memory, crops batched in torch; the second
is ``plain_fixed_resolution``, the same loop at the final phase for every epoch. Ratios:
``ratios.vs_plain_same_recipe_{train,wall}_s.<target>`` and ``ratios.vs_plain_fixed_res_{train,wall}_s.<target>``.
The decode into memory counts as the baselines' start-up (their wall time), as prepare counts as lightray's.
    python -m bench.time_to_accuracy --dataset cifar10 --repeats 3
    python -m bench.time_to_accuracy --dataset cifar10 --quick --target 0.3     # the smallest check

``--dataset imagenette`` (``--data``: a tree of class folders, default ``../shared/data/imagenette``, the
training split of Imagenette2 at 224 px): the ``imagenette`` recipe (96 -> 128 px, 5 epochs), validated on its
seeded hold-out. The same two baselines; the same-recipe one holds the tree resized once to each phase's size
(``plain_recipe.load_tree``, the run's own listing and hold-out), as fast.ai's resized copies. Every side's
top-1 after each epoch is in ``top1_per_epoch``: accuracy per epoch is the measure that holds on any hardware.
    python -m bench.time_to_accuracy --dataset imagenette --repeats 2 --no-fixed
    python -m bench.time_to_accuracy --dataset imagenette --quick --target 0.3   # 1,000 photos, 2 epochs
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common import Machine, emit, load_avg, machine_cores, note, ratio, read_jsonl, resolved_ratio, spread

DEFAULT_STORAGE = os.path.join(os.environ.get("TMPDIR", "/tmp"), "lightray-bench-tta")
EXAMPLE_LRS_PER_256 = (0.1, 0.3, 0.9)  # the example's own 0.1, then x3 and x9
EXAMPLE_BATCH = 128


def quick_overrides() -> dict[str, Any]:
    """A correctness run that still has to learn: 4 of the demo's classes (chance 0.25), 1,200 training images,
    8 epochs, the recipe's phases (resolutions, crop scales, fractions) at batch 32 instead of the recipe's
    (twice the steps for the same images; the LR follows the batch). Measured here: 600 images for 6 epochs at
    24/32 px left both lightray and the tuned baseline below 0.5. The optimiser, warm-up, decay and smoothing
    stay the recipe's."""
    from lightray.config import load_config

    phases = [{"until": ph.until, "until_epoch": ph.until_epoch, "resolution": ph.resolution, "batch_size": 32,
               "min_scale": ph.min_scale} for ph in load_config("demo").schedule.phases]
    return {"data.demo_classes": 4, "data.demo_train_per_class": 300, "data.demo_val_per_class": 50,
            "schedule.epochs": 8, "schedule.phases": phases, "report.eval_sweep": [], "data.autotune_seconds": 0.0}


def demo_tree(storage: str, overrides: dict[str, Any]) -> str:
    """The demo ImageFolder tree lightray's prepare will use (same path, so it is made only once)."""
    from lightray.config import load_config
    from lightray.data.demo import ensure_demo
    from lightray.data.prepare import resolve_cache_root

    cfg = load_config("demo", {"storage": storage, **overrides})
    root = resolve_cache_root(cfg)
    os.makedirs(root, exist_ok=True)
    return ensure_demo(root, cfg.data)


def _to_targets(history: list[dict[str, Any]], targets: list[float], train_key: str, wall_key: str
                ) -> dict[str, dict[str, Any]]:
    """Per target: the first epoch record at or above it (training s, wall s incl. start-up, epochs)."""
    out: dict[str, dict[str, Any]] = {}
    for t in targets:
        hit = next((r for r in history if float(r["val_top1"]) >= t), None)
        out[f"{t:g}"] = {"reached": hit is not None, "train_s": float(hit[train_key]) if hit else None,
                         "wall_s": float(hit[wall_key]) if hit else None,
                         "epochs": int(hit["epoch"]) if hit else None}
    return out


def _side_result(history: list[dict[str, Any]], targets: list[float], startup_s: float, total_wall_s: float,
                 **extra: Any) -> dict[str, Any]:
    """One side's figures from its validated epochs' records (every epoch, unless ``schedule.eval_every_epochs``
    skips some: ``top1_per_epoch`` and ``epoch_s`` then run from one validation to the next)."""
    epochs_run = int(history[-1]["epoch"])
    return {"by_target": _to_targets(history, targets, "train_s", "wall_s"), "startup_s": startup_s,
            "epochs_run": epochs_run, "best_top1": max(float(r["val_top1"]) for r in history),
            "train_s_total": float(history[-1]["train_s"]), "total_wall_s": total_wall_s,
            "train_s_per_epoch": float(history[-1]["train_s"]) / epochs_run,
            "validated_epochs": [int(r["epoch"]) for r in history],
            "top1_per_epoch": [round(float(r["val_top1"]), 4) for r in history],
            "epoch_s": [round(float(r["train_s"]) - float(p["train_s"]), 3)
                        for p, r in zip([{"train_s": 0.0}] + history, history)], **extra}


def epoch_gaps(light_runs: list[dict[str, Any]], base_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Where lightray's training time goes against a baseline's, epoch by epoch (from one validation to the next
    where ``schedule.eval_every_epochs`` skips some; both sides validate on the same epochs): per epoch that both
    sides ran in a repeat (a baseline stops at the highest target), lightray's seconds less the baseline's, as the
    median over the repeats, with their sum. The same seed gives both sides the same epochs' work."""
    per_epoch: list[list[float]] = []
    for lt, b in zip(light_runs, base_runs):
        for i, (x, y) in enumerate(zip(lt["epoch_s"], b["epoch_s"])):
            if len(per_epoch) <= i:
                per_epoch.append([])
            per_epoch[i].append(x - y)
    medians = [spread(v, 3)["median"] for v in per_epoch]
    return {"lightray_minus_baseline_s": medians, "sum_s": round(sum(medians), 2),
            "repeats_per_epoch": [len(v) for v in per_epoch]}


# --- the plain PyTorch loop both baselines share -------------------------------------------------------
def _plain_loop(model: torch.nn.Module, train_loader, val_loader, opt: torch.optim.Optimizer, criterion,
                set_lr, *, epochs: int, targets: list[float], channels_last: bool, t_start: float, label: str,
                precision: str = "fp32", eval_every: int = 1) -> tuple[list[dict[str, Any]], float]:
    """Train, and validate every ``eval_every``-th epoch and the last (0 = the last only, as
    ``schedule.eval_every_epochs``), until the highest target or ``epochs``; ``set_lr(epoch, step,
    steps_per_epoch)`` runs before each step. Returns the validated epochs' records and the start-up seconds."""
    from lightray.schedule import validates_after
    from lightray.train.device import autocast

    cpu = torch.device("cpu")
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    steps_per_epoch = len(train_loader)
    history: list[dict[str, Any]] = []
    t_train = time.perf_counter()
    startup = t_train - t_start
    for epoch in range(epochs):
        model.train()
        loss_sum, n = 0.0, 0
        for step, (x, y) in enumerate(train_loader):
            set_lr(epoch, step, steps_per_epoch)
            with autocast(precision, cpu):
                loss = criterion(model(x.contiguous(memory_format=fmt)), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += float(loss.detach()) * len(y)
            n += len(y)
        if not validates_after(epoch, epochs, eval_every):
            continue
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in val_loader:
                with autocast(precision, cpu):
                    correct += int((model(x.contiguous(memory_format=fmt)).argmax(1) == y).sum())
                total += len(y)
        now = time.perf_counter()
        rec = {"epoch": epoch + 1, "train_loss": loss_sum / max(1, n), "val_top1": correct / max(1, total),
               "train_s": now - t_train, "wall_s": now - t_start}
        history.append(rec)
        note(f"{label} epoch {epoch + 1}/{epochs}: loss {rec['train_loss']:.3f} top-1 {rec['val_top1']:.3f} "
             f"({rec['train_s']:.0f} s)")
        if rec["val_top1"] >= max(targets):
            break
    return history, startup


def _folders(tree: str, train_tf, val_tf, classes_expected: int):
    from torchvision.datasets import ImageFolder

    train_set = ImageFolder(os.path.join(tree, "train"), train_tf)
    val_set = ImageFolder(os.path.join(tree, "val"), val_tf)
    if len(train_set.classes) != classes_expected:
        raise RuntimeError(f"demo tree {tree}: {len(train_set.classes)} classes, expected {classes_expected}")
    return train_set, val_set


def _normalize():
    import torchvision.transforms as T

    from lightray.train.device import IMAGENET_MEAN, IMAGENET_STD

    return T.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD)


# --- (a) the recipe's hyper-parameters in plain PyTorch ------------------------------------------------
def run_tuned_plain(tree: str, cfg, *, targets: list[float], threads: int, loader_workers: int,
                    seed: int) -> dict[str, Any]:
    import torchvision.transforms as T
    from torch import nn

    from lightray.schedule import Schedule
    from lightray.train.device import precision_for
    from lightray.train.model import build_model

    if cfg.optim.name != "sgd":
        raise RuntimeError(f"optim.name={cfg.optim.name}: the plain baseline reproduces SGD recipes only")
    t_start = time.perf_counter()
    torch.set_num_threads(threads)
    final = cfg.schedule.phases[-1]
    res, batch = final.resolution, final.batch_size
    eval_res = cfg.schedule.eval_resolution or res
    norm = _normalize()
    train_set, val_set = _folders(
        tree, T.Compose([T.RandomResizedCrop(res, scale=(final.min_scale, 1.0)), T.RandomHorizontalFlip(),
                         T.ToTensor(), norm]),
        T.Compose([T.Resize(round(eval_res / cfg.data.val_crop_ratio)), T.CenterCrop(eval_res), T.ToTensor(), norm]),
        cfg.data.demo_classes)
    loader_kw = {"num_workers": loader_workers, "persistent_workers": loader_workers > 0}
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=batch, shuffle=True, drop_last=True,
                                               **loader_kw)
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=batch, shuffle=False, **loader_kw)
    torch.manual_seed(seed)
    model = build_model(cfg.model, len(train_set.classes))
    if cfg.model.channels_last:
        model = model.to(memory_format=torch.channels_last)
    # The usual plain-PyTorch split: 1-d tensors (BN scale/shift, biases) take no weight decay.
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    wd = cfg.optim.weight_decay
    peak = cfg.optim.lr_per_256 * batch / 256
    opt = torch.optim.SGD([{"params": decay, "weight_decay": wd},
                           {"params": no_decay, "weight_decay": wd if cfg.optim.bn_bias_decay else 0.0}],
                          lr=peak, momentum=cfg.optim.momentum, nesterov=cfg.optim.nesterov)
    # The recipe's curve (warm-up from its start factor, then its decay), by epoch progress, for this epoch count.
    shape = Schedule(cfg.schedule, cfg.optim, len(train_set)).lr_shape

    def set_lr(epoch: int, step: int, steps_per_epoch: int) -> None:
        progress = epoch + step / steps_per_epoch
        momentum = cfg.optim.momentum
        if cfg.schedule.momentum_schedule:
            momentum = max(0.0, momentum - 0.1 * shape(progress))
        for g in opt.param_groups:
            g["lr"], g["momentum"] = peak * shape(progress), momentum

    history, startup = _plain_loop(model, train_loader, val_loader, opt,
                                   nn.CrossEntropyLoss(label_smoothing=cfg.optim.label_smoothing), set_lr,
                                   epochs=int(cfg.schedule.epochs), targets=targets,
                                   channels_last=cfg.model.channels_last, t_start=t_start, label="tuned plain",
                                   precision=precision_for(cfg.model, torch.device("cpu")),
                                   eval_every=int(cfg.schedule.eval_every_epochs))
    return _side_result(history, targets, startup, time.perf_counter() - t_start, train_images=len(train_set),
                        val_images=len(val_set), resolution=res, eval_resolution=eval_res, batch=batch,
                        lr_peak=peak, threads=torch.get_num_threads(), loader_workers=loader_workers)


# --- (b) the PyTorch ImageNet example ---------------------------------------------------------------
def run_example(tree: str, cfg, *, targets: list[float], lr_per_256: float, threads: int, loader_workers: int,
                seed: int, epochs: int | None = None) -> dict[str, Any]:
    import torchvision.transforms as T
    from torch import nn

    from lightray.config import ModelConfig
    from lightray.train.model import build_model

    t_start = time.perf_counter()
    torch.set_num_threads(threads)
    res = cfg.schedule.phases[-1].resolution
    norm = _normalize()
    train_set, val_set = _folders(
        tree, T.Compose([T.RandomResizedCrop(res), T.RandomHorizontalFlip(), T.ToTensor(), norm]),
        T.Compose([T.Resize(round(res / 0.875)), T.CenterCrop(res), T.ToTensor(), norm]), cfg.data.demo_classes)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=EXAMPLE_BATCH, shuffle=True,
                                               num_workers=loader_workers)
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=EXAMPLE_BATCH, shuffle=False,
                                             num_workers=loader_workers)
    torch.manual_seed(seed)
    model = build_model(ModelConfig(arch=cfg.model.arch, zero_init_residual=False, channels_last=False),
                        len(train_set.classes))
    lr = lr_per_256 * EXAMPLE_BATCH / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    epochs = int(cfg.schedule.epochs) if epochs is None else epochs
    step_every = max(1, round(0.3 * epochs))

    def set_lr(epoch: int, step: int, steps_per_epoch: int) -> None:
        for g in opt.param_groups:
            g["lr"] = lr * 0.1 ** (epoch // step_every)

    history, startup = _plain_loop(model, train_loader, val_loader, opt, nn.CrossEntropyLoss(), set_lr,
                                   epochs=epochs, targets=targets, channels_last=False, t_start=t_start,
                                   label=f"pytorch example (lr/256 {lr_per_256:g})")
    return _side_result(history, targets, startup, time.perf_counter() - t_start, lr_per_256=lr_per_256, lr=lr,
                        lr_step_every_epochs=step_every, epochs=epochs)


def _example_rank(res: dict[str, Any], targets: list[float]) -> tuple:
    """Sort key of a sweep run: most targets reached, then sooner to the highest of them, then best top-1."""
    reached = [t for t in sorted(targets) if res["by_target"][f"{t:g}"]["reached"]]
    soonest = res["by_target"][f"{reached[-1]:g}"]["train_s"] if reached else 0.0
    return (-len(reached), soonest, -res["best_top1"])


# --- (c) lightray's demo recipe ---------------------------------------------------------------------
def run_lightray(storage: str, overrides: dict[str, Any], targets: list[float], seed: int,
                 recipe: str = "demo", before_shutdown: Callable[[], Any] | None = None) -> dict[str, Any]:
    """``before_shutdown``: called after the run while its Ray cluster is still up (a bench reading Ray's state)."""
    import ray

    from lightray.config import load_config
    from lightray.driver.runner import run_training

    name = f"tta-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-s{seed}"
    cfg = load_config(recipe, {"storage": storage, "name": name, "scaling.ray_address": "local",
                               "scaling.seed": seed, "report.targets": list(targets), **overrides})
    t0_unix, t0 = time.time(), time.perf_counter()
    # Ray forwards its raylet's and workers' warnings to the driver's stdout; stdout holds only the JSON line.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            run_training(cfg, progress=False, stream=sys.stderr)
            if before_shutdown is not None:
                before_shutdown()
        finally:
            ray.shutdown()
    total = time.perf_counter() - t0
    vals = [r for r in read_jsonl(os.path.join(storage, name, "metrics.jsonl")) if "val_top1" in r]
    if not vals:
        raise RuntimeError(f"lightray run {storage}/{name}: no validation records in metrics.jsonl")
    history = [{"epoch": int(r["epoch"]), "val_top1": float(r["val_top1"]), "train_s": float(r["elapsed_s"]),
                "wall_s": float(r["time"]) - t0_unix} for r in vals]
    # Start-up: the wall time not covered by the training clock when the first epoch's record was written.
    startup = history[0]["wall_s"] - history[0]["train_s"]
    return _side_result(history, targets, startup, total, workers=cfg.worker_range()[1],
                        run_dir=os.path.join(storage, name))


# --- summaries -----------------------------------------------------------------------------------------
def summarize_side(runs: list[dict[str, Any]], targets: list[float]) -> dict[str, Any]:
    """Median/min/max/runs of every figure of one side over the repeats."""
    out: dict[str, Any] = {key: spread([r[key] for r in runs], 2)
                           for key in ("startup_s", "total_wall_s", "train_s_total", "train_s_per_epoch")}
    out["best_top1"] = spread([r["best_top1"] for r in runs], 4)
    out["epochs_run"] = [r["epochs_run"] for r in runs]
    out["validated_epochs"] = [r["validated_epochs"] for r in runs]  # the epochs top1_per_epoch scores
    out["top1_per_epoch"] = [r["top1_per_epoch"] for r in runs]
    out["epoch_s"] = [r["epoch_s"] for r in runs]
    for key in ("train_s", "wall_s"):
        out[f"{key}_to_target"] = {f"{t:g}": spread([r["by_target"][f"{t:g}"][key] for r in runs], 2)
                                   for t in targets}
    out["reached"] = {f"{t:g}": [r["by_target"][f"{t:g}"]["reached"] for r in runs] for t in targets}
    out["epochs_to_target"] = {f"{t:g}": [r["by_target"][f"{t:g}"]["epochs"] for r in runs] for t in targets}
    return out


def ratios_against(base_runs: list[dict[str, Any]], light_runs: list[dict[str, Any]], targets: list[float],
                   prefix: str) -> dict[str, Any]:
    """``<prefix>_{train,wall}_s.<target>``: baseline over lightray seconds per repeat, then summarised."""
    out: dict[str, Any] = {}
    for key in ("train_s", "wall_s"):
        out[f"{prefix}_{key}"] = {
            f"{t:g}": resolved_ratio([ratio(b["by_target"][f"{t:g}"][key], lt["by_target"][f"{t:g}"][key])
                                      for b, lt in zip(base_runs, light_runs)])
            for t in targets}
    return out


# --- real photos: CIFAR-10 (Parquet) and Imagenette (a tree), against the same recipe in plain PyTorch ---------
SHARED_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "shared", "data")
DEFAULT_DATA = {"cifar10": os.path.join(SHARED_DATA, "cifar10"), "imagenette": os.path.join(SHARED_DATA, "imagenette")}
QUICK = {  # a check, not a figure: few photos, few epochs, the recipe's phases at batch 64 (the LR follows it);
    # CIFAR-10's VGG at a third of its widths, a ninth of the step's cost (the check is of the plumbing, not the model)
    "cifar10": {"data.limit_train": 4000, "data.limit_val": 500, "schedule.epochs": 4, "model.widths": [16, 64, 64]},
    "imagenette": {"data.limit_train": 1000, "data.limit_val": 200, "schedule.epochs": 2},
}


def photo_overrides(dataset: str, data: str, quick: bool) -> dict[str, Any]:
    """The ``dataset`` recipe on ``data``; ``quick``: :data:`QUICK`'s photos and epochs."""
    from lightray.config import load_config

    out: dict[str, Any] = {"data.source": data}
    if quick:
        phases = [{"until": p.until, "scale": p.scale, "resolution": p.resolution, "batch_size": 64,
                   "min_scale": p.min_scale} for p in load_config(dataset).schedule.phases]
        out.update({**QUICK[dataset], "schedule.phases": phases})
    return out


def tree_arrays(tree: str, cfg) -> tuple[Any, dict[str, Any]]:
    """An image tree (the demo's, Imagenette's) as the same-recipe baseline holds it (every phase's size, the
    eval crop; the run's hold-out and limits), and the recipe fitted to its native size as a run fits it."""
    import copy

    from bench import plain_recipe
    from lightray.config import default_eval_resolution
    from lightray.data import native
    from lightray.data.prepare import tiers_for

    sizes = sorted({p.resolution for p in cfg.schedule.phases})
    eval_size = default_eval_resolution(cfg.schedule)
    tiers = tiers_for(cfg)
    eval_tier = next((t for t in tiers if t >= eval_size), tiers[-1])  # as Manifest.tier_for picks a run's
    arrays = plain_recipe.load_tree(tree, sizes, eval_size, eval_tier, cfg.data.val_crop_ratio,
                                    cfg.data.val_fraction, cfg.data.val_seed,
                                    {"train": cfg.data.limit_train, "val": cfg.data.limit_val})
    fitted = copy.deepcopy(cfg)
    native.fit_schedule(fitted, arrays["native_short_side"])
    missing = sorted({p.resolution for p in fitted.schedule.phases} - set(arrays["train_by_res"]))
    if missing:
        raise RuntimeError(f"tree {tree}: the recipe fitted to its native size "
                           f"{arrays['native_short_side']} px trains at {missing} px, which were not prepared")
    return fitted, arrays


def plain_side(cfg, arrays: dict[str, Any], targets: list[float], threads: int, seed: int,
               fixed_final: bool) -> dict[str, Any]:
    from bench import plain_recipe

    t0 = time.perf_counter()
    history, startup = plain_recipe.run(cfg, arrays, targets=targets, threads=threads, seed=seed,
                                        fixed_final=fixed_final,
                                        label="plain fixed resolution" if fixed_final else "plain same recipe")
    decode = arrays["decode_s"]  # the one-off decode into memory is the baseline's start-up, as prepare is lightray's
    for r in history:
        r["wall_s"] += decode
    return _side_result(history, targets, startup + decode, time.perf_counter() - t0 + decode,
                        threads=threads, fixed_final=fixed_final)


def photo_inputs(args: argparse.Namespace) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """The overrides, the recipe as the plain sides take it (fitted to the photos' native size, as a run fits
    it) and the photos decoded once for them."""
    from bench import plain_recipe
    from lightray.config import load_config
    from lightray.data import native

    overrides = photo_overrides(args.dataset, args.data, args.quick)
    cfg = load_config(args.dataset, overrides)
    if args.dataset == "imagenette":
        cfg, arrays = tree_arrays(args.data, cfg)
        return overrides, cfg, arrays
    arrays = plain_recipe.load_arrays(args.data, cfg.data.val_fraction, cfg.data.val_seed,
                                      {"train": cfg.data.limit_train, "val": cfg.data.limit_val})
    native.fit_schedule(cfg, int(min(arrays["train"][0].shape[1:3])))
    return overrides, cfg, arrays


def main_photos(args: argparse.Namespace, repeats: int) -> int:
    overrides, cfg, arrays = photo_inputs(args)
    targets = sorted(args.target if args.target else list(cfg.report.targets))
    threads = args.plain_threads or machine_cores()
    machine = Machine()
    note(f"{args.dataset}: {len(arrays['train'][1])} train / {len(arrays['val'][1])} val photos decoded in "
         f"{arrays['decode_s']:.1f} s; {repeats} repeat(s); plain sides: {threads} torch threads")
    light, same, fixed, loads = [], [], [], []
    for rep in range(repeats):
        seed = args.seed + rep
        loads.append(load_avg())
        for side in (("lightray", "same") if rep % 2 == 0 else ("same", "lightray")):
            note(f"repeat {rep + 1}/{repeats}: {side} (seed {seed}, load {load_avg()})")
            if side == "lightray":
                light.append(run_lightray(args.storage, overrides, targets, seed, recipe=args.dataset))
            else:
                same.append(plain_side(cfg, arrays, targets, threads, seed, fixed_final=False))
        if not args.no_fixed:
            note(f"repeat {rep + 1}/{repeats}: plain fixed resolution (seed {seed}, load {load_avg()})")
            fixed.append(plain_side(cfg, arrays, targets, threads, seed, fixed_final=True))
    final = cfg.schedule.phases[-1]
    figures: dict[str, Any] = {
        "dataset": args.dataset, "source": args.data, "targets": targets, "repeats": repeats,
        "seeds": [args.seed + r for r in range(repeats)], "model": cfg.model.arch, "widths": list(cfg.model.widths),
        "train_images": len(arrays["train"][1]), "val_images": len(arrays["val"][1]),
        "val": f"seeded hold-out of the training split (data.val_fraction={cfg.data.val_fraction:g}, "
               f"seed {cfg.data.val_seed})", "load_1m_at_repeat_start": loads,
        "recipe": {"epochs": int(cfg.schedule.epochs), "phases": [[p.resolution, p.batch_size, p.min_scale]
                                                                  for p in cfg.schedule.phases],
                   "final_resolution": final.resolution, "eval_resolution": cfg.schedule.eval_resolution},
        "lightray": {**summarize_side(light, targets), "workers": light[0]["workers"],
                     "run_dirs": [r["run_dir"] for r in light]},
        "plain_same_recipe": {**summarize_side(same, targets), "threads": threads, "processes": 1,
                              "data": "decoded uint8 arrays in memory" + (", one per phase size" if "train_by_res"
                                                                          in arrays else "")
                                      + ", batched roi_align crops"},
    }
    figures["epoch_gap_vs_plain_same_recipe"] = epoch_gaps(light, same)
    ratios = ratios_against(same, light, targets, "vs_plain_same_recipe")
    if fixed:
        figures["plain_fixed_resolution"] = {**summarize_side(fixed, targets), "threads": threads,
                                             "resolution": final.resolution}
        ratios.update(ratios_against(fixed, light, targets, "vs_plain_fixed_res"))
    emit("time_to_accuracy", figures, ratios, machine.finish(None, quick=args.quick, repeats=repeats,
                                                              dataset=args.dataset, plain_threads=threads))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The bench's command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", type=float, nargs="+", default=None,
                   help="top-1 targets (default: the recipe's report.targets); the highest ends the baselines")
    p.add_argument("--repeats", type=int, default=None, help="runs of every side (default 3; 1 with --quick)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first repeat; repeat i uses seed + i")
    p.add_argument("--plain-threads", type=int, default=None, help="baselines' torch threads (default: cores)")
    p.add_argument("--plain-loader-workers", type=int, default=None,
                   help="baselines' DataLoader workers (default: cores)")
    p.add_argument("--example-lr-per-256", type=float, nargs="+", default=list(EXAMPLE_LRS_PER_256),
                   help="the PyTorch example's LR sweep, per 256 images (its batch is 128)")
    p.add_argument("--no-example", action="store_true", help="skip the PyTorch-example baseline")
    p.add_argument("--example-epochs", type=int, default=None,
                   help="the PyTorch example's epochs (default: the recipe's); fewer make a quick check quicker")
    p.add_argument("--storage", default=DEFAULT_STORAGE,
                   help="lightray storage; its cache/ holds the demo tree and shard cache, kept between runs")
    p.add_argument("--quick", action="store_true", help="4 classes, 1,200 images, 8 epochs, 1 repeat: a check "
                   "(cifar10: 4,000 photos, 4 epochs)")
    p.add_argument("--dataset", choices=["demo", "cifar10", "imagenette"], default="demo",
                   help="demo (synthetic shapes), or real photos with their recipe: cifar10, imagenette")
    p.add_argument("--data", default=None, help="cifar10: the training split as Parquet; imagenette: a tree of "
                   "class folders (default: ../shared/data/<dataset>)")
    p.add_argument("--no-fixed", action="store_true", help="cifar10, imagenette: skip the fixed-resolution loop")
    return p


@dataclasses.dataclass
class DemoInputs:
    """What every demo repeat runs on: the data tree, the recipe (as shipped and as the plain same-recipe side
    takes it), the decoded arrays, the targets and the baselines' threads and loader workers."""
    overrides: dict[str, Any]
    tree: str
    demo_cfg: Any
    same_cfg: Any
    arrays: dict[str, Any]
    targets: list[float]
    threads: int
    loader_workers: int


@dataclasses.dataclass
class DemoRuns:
    """Every side's runs over the repeats, the PyTorch example's LR sweep and chosen LR, and the load average at
    the start of each repeat."""
    light: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    same: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    tuned: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    example: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    sweep: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    chosen_lr: float | None = None
    loads: list[float] = dataclasses.field(default_factory=list)


def _main_sides(args: argparse.Namespace, inp: DemoInputs, runs: DemoRuns, rep: int, repeats: int,
                seed: int) -> None:
    """One repeat of lightray and the two recipe baselines, in an order that alternates between repeats."""
    # Alternate the order of the main sides: a load drift then favours each of them as often.
    sides = ("lightray", "plain_same_recipe", "tuned_plain")
    for side in (sides if rep % 2 == 0 else sides[::-1]):
        note(f"repeat {rep + 1}/{repeats}: {side} (seed {seed}, load {load_avg()})")
        if side == "lightray":
            runs.light.append(run_lightray(args.storage, inp.overrides, inp.targets, seed))
        elif side == "plain_same_recipe":
            runs.same.append(plain_side(inp.same_cfg, inp.arrays, inp.targets, inp.threads, seed, fixed_final=False))
        else:
            runs.tuned.append(run_tuned_plain(inp.tree, inp.demo_cfg, targets=inp.targets, threads=inp.threads,
                                              loader_workers=inp.loader_workers, seed=seed))


def _example_side(args: argparse.Namespace, inp: DemoInputs, runs: DemoRuns, rep: int, seed: int) -> None:
    """One repeat of the PyTorch example: the whole LR sweep the first time (its best run counts and fixes the
    LR), then one run at the chosen LR."""
    if runs.chosen_lr is None:
        for lr in args.example_lr_per_256:
            note(f"repeat {rep + 1}: PyTorch example, LR sweep {lr:g} per 256 (load {load_avg()})")
            runs.sweep.append(run_example(inp.tree, inp.demo_cfg, targets=inp.targets, lr_per_256=lr,
                                          threads=inp.threads, loader_workers=inp.loader_workers, seed=seed,
                                          epochs=args.example_epochs))
        best = min(runs.sweep, key=lambda r: _example_rank(r, inp.targets))
        runs.chosen_lr = best["lr_per_256"]
        runs.example.append(best)
    else:
        note(f"repeat {rep + 1}: PyTorch example at the swept LR {runs.chosen_lr:g} per 256 (load {load_avg()})")
        runs.example.append(run_example(inp.tree, inp.demo_cfg, targets=inp.targets, lr_per_256=runs.chosen_lr,
                                        threads=inp.threads, loader_workers=inp.loader_workers, seed=seed,
                                        epochs=args.example_epochs))


def measure(args: argparse.Namespace, inp: DemoInputs, repeats: int) -> DemoRuns:
    """Every repeat of every demo side (the PyTorch example last in each, unless ``--no-example``)."""
    runs = DemoRuns()
    for rep in range(repeats):
        seed = args.seed + rep
        runs.loads.append(load_avg())
        _main_sides(args, inp, runs, rep, repeats, seed)
        if args.no_example:
            continue
        _example_side(args, inp, runs, rep, seed)
    return runs


def _example_figures(runs: DemoRuns, targets: list[float]) -> dict[str, Any]:
    """The PyTorch example's figures: its runs at the chosen LR and every run of the LR sweep."""
    return {
        **summarize_side(runs.example, targets), "lr_per_256": runs.chosen_lr, "batch": EXAMPLE_BATCH,
        "lr_step_every_epochs": runs.example[0]["lr_step_every_epochs"], "epochs": runs.example[0]["epochs"],
        "lr_sweep": [{"lr_per_256": r["lr_per_256"], "best_top1": round(r["best_top1"], 4),
                      "chosen": r["lr_per_256"] == runs.chosen_lr, "top1_per_epoch": r["top1_per_epoch"],
                      "train_s_to_target": {k: None if v["train_s"] is None else round(v["train_s"], 2)
                                            for k, v in r["by_target"].items()}} for r in runs.sweep]}


def summarise(args: argparse.Namespace, inp: DemoInputs, runs: DemoRuns, repeats: int,
              demo_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """The demo bench's (figures, ratios): each side summarised, and baseline over lightray seconds."""
    targets, demo_cfg = inp.targets, inp.demo_cfg
    tuned0 = runs.tuned[0]
    final = demo_cfg.schedule.phases[-1]
    figures: dict[str, Any] = {
        "targets": targets, "repeats": repeats, "seeds": [args.seed + r for r in range(repeats)],
        "model": demo_cfg.model.arch, "demo_tree_s": round(demo_s, 1), "train_images": tuned0["train_images"],
        "val_images": tuned0["val_images"], "load_1m_at_repeat_start": runs.loads,
        "recipe": {"epochs": int(demo_cfg.schedule.epochs), "warmup": demo_cfg.schedule.warmup,
                   "decay": demo_cfg.schedule.decay, "lr_per_256": demo_cfg.optim.lr_per_256,
                   "momentum": demo_cfg.optim.momentum, "nesterov": demo_cfg.optim.nesterov,
                   "weight_decay": demo_cfg.optim.weight_decay, "bn_bias_decay": demo_cfg.optim.bn_bias_decay,
                   "label_smoothing": demo_cfg.optim.label_smoothing, "final_resolution": final.resolution,
                   "final_batch": final.batch_size, "final_min_scale": final.min_scale},
        "lightray": {**summarize_side(runs.light, targets), "workers": runs.light[0]["workers"],
                     "run_dirs": [r["run_dir"] for r in runs.light]},
        "plain_same_recipe": {**summarize_side(runs.same, targets), "threads": inp.threads, "processes": 1,
                              "decode_s": round(inp.arrays["decode_s"], 2),
                              "data": "the tree resized once to each phase's size, decoded uint8 arrays in "
                                      "memory, batched roi_align crops"},
        "tuned_plain": {**summarize_side(runs.tuned, targets), "resolution": tuned0["resolution"],
                        "eval_resolution": tuned0["eval_resolution"], "batch": tuned0["batch"],
                        "lr_peak": tuned0["lr_peak"], "threads": tuned0["threads"],
                        "loader_workers": tuned0["loader_workers"], "processes": 1},
    }
    figures["epoch_gap_vs_plain_same_recipe"] = epoch_gaps(runs.light, runs.same)
    ratios = ratios_against(runs.same, runs.light, targets, "vs_plain_same_recipe")
    ratios.update(ratios_against(runs.tuned, runs.light, targets, "vs_tuned_plain"))
    if runs.example:
        figures["pytorch_example"] = _example_figures(runs, targets)
        ratios.update(ratios_against(runs.example, runs.light, targets, "vs_pytorch_example"))
    return figures, ratios


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if repeats < 1:
        p.error(f"--repeats={repeats}: expected a positive integer")
    if args.dataset != "demo":
        for t in args.target or []:
            if not 0 < t <= 1:
                p.error(f"--target={t}: expected a top-1 fraction in (0, 1]")
        args.data = args.data or DEFAULT_DATA[args.dataset]
        return main_photos(args, repeats)
    if args.example_epochs is not None and args.example_epochs < 1:
        p.error(f"--example-epochs={args.example_epochs}: expected a positive integer")
    overrides = quick_overrides() if args.quick else {}

    from lightray.config import load_config

    demo_cfg = load_config("demo", overrides)
    targets = sorted(args.target if args.target else list(demo_cfg.report.targets))
    for t in targets:
        if not 0 < t <= 1:
            p.error(f"--target={t}: expected a top-1 fraction in (0, 1]")
    cores = machine_cores()
    threads = args.plain_threads or cores
    loader_workers = cores if args.plain_loader_workers is None else args.plain_loader_workers
    machine = Machine()
    t = time.perf_counter()
    tree = demo_tree(args.storage, overrides)
    demo_s = time.perf_counter() - t
    same_cfg, arrays = tree_arrays(tree, demo_cfg)
    note(f"demo tree {tree} ready ({demo_s:.1f} s), decoded at {sorted(arrays['train_by_res'])} px for the same "
         f"recipe in plain PyTorch ({arrays['decode_s']:.1f} s); {repeats} repeat(s); baselines: {threads} torch "
         f"threads, {loader_workers} loader workers")

    inp = DemoInputs(overrides, tree, demo_cfg, same_cfg, arrays, targets, threads, loader_workers)
    runs = measure(args, inp, repeats)
    figures, ratios = summarise(args, inp, runs, repeats, demo_s)
    emit("time_to_accuracy", figures, ratios,
         machine.finish(argv, quick=args.quick, repeats=repeats, plain_threads=threads,
                        plain_loader_workers=loader_workers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
