"""The strongest plain baseline for time to accuracy: lightray's recipe, the whole of it, in one plain PyTorch
process over decoded images held in memory.

What a skilled user writes for a dataset that fits in RAM (the fast CIFAR-10 trainers' way): decode the
photos once into one uint8 array, then every step takes a random batch of it and augments it in torch, batched
(random-resized crop + flip as one ``roi_align``), with ``torch.set_num_threads`` set for the machine. The
recipe is the run's own, read through ``load_config`` and fitted to the data as a run fits it: its phases
(resolution, global batch, crop scale) by epoch, the optimiser and its parameter groups, the LR and momentum
curves as functions of samples seen, label smoothing, the EMA of the weights, flip test-time augmentation and
the fast CIFAR-10 trainers' units (translate, the translated views, the whitened stem, BN's LR factor, lookahead),
each built by the same lightray function the run calls (so both sides do the same arithmetic). The split is
the run's own: the same seeded hold-out of the same rows. ``fixed_final`` trains every epoch at the final
phase instead (the fixed-resolution loop, the second baseline).

Images of many sizes (the demo's, like ImageNet's) are prepared as a skilled user prepares them for a
progressive recipe (fast.ai's resized copies): :func:`load_tree` resizes every training image once per phase
size (short side), holds each size decoded in one edge-padded uint8 array with every image's own height and
width, and centre-crops the validation images once at the eval size.
"""

from __future__ import annotations

import io
import time
from typing import Any

import numpy as np
import torch
from PIL import Image


def load_arrays(source: str, val_fraction: float, seed: int, limits: dict[str, int]) -> dict[str, Any]:
    """The train and val rows of a Parquet source as uint8 NHWC arrays and int64 labels: the rows a run takes
    (its hold-out, its evenly spaced limit), decoded once. Every image must have one size (CIFAR-10's 32 px)."""
    from lightray.data import sources_parquet
    from lightray.data.source import resolve_fs
    from lightray.data.sources import list_source

    t0 = time.perf_counter()
    listing = list_source(source, val_fraction, seed, explicit=False)
    if listing.kind != "parquet":
        raise ValueError(f"{source}: the in-memory baseline reads Parquet sources; this one is {listing.kind}")
    fs, base = resolve_fs(listing.root)
    out: dict[str, Any] = {"classes": listing.classes}
    for split in ("train", "val"):
        imgs, labels = [], []
        for unit in sources_parquet.plan_units(listing, split, limits.get(split, 0), 1 << 20):
            unit = {**unit, "options": listing.options, "classes": listing.classes}
            for _sid, _path, label, data, _reason in sources_parquet.iter_samples(unit, fs, base):
                if data is not None:
                    imgs.append(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
                    labels.append(label)
        shapes = {a.shape for a in imgs}
        if len(shapes) != 1:
            raise ValueError(f"{source}: {split} images have {len(shapes)} sizes; the in-memory baseline needs one")
        out[split] = (np.stack(imgs), np.asarray(labels, np.int64))
    out["decode_s"] = time.perf_counter() - t0
    return out


def tree_samples(tree: str, val_fraction: float = 0.0, seed: int = 0, limits: dict[str, int] | None = None
                 ) -> tuple[list[str], dict[str, list]]:
    """The classes and per split the (path, label) pairs of an image tree, as a run lists them: the same class
    order, the same files, for a tree without ``val/`` the same seeded hold-out (``data.val_fraction``,
    ``data.val_seed``), and a limit's same evenly spaced files (``data.limit_train``, ``data.limit_val``)."""
    from lightray.data.prepare import selected_ids
    from lightray.data.source import run_val_fraction
    from lightray.data.sources import list_source

    listing = list_source(tree, run_val_fraction(tree, val_fraction), seed, val_fraction > 0)
    out = {}
    for split in ("train", "val"):
        table = listing.splits[split].table
        cols = table.take(selected_ids(len(table), (limits or {}).get(split, 0))).select(["path", "label"])
        cols = cols.to_pydict()
        out[split] = [(f"{listing.root}/{p}", int(lab)) for p, lab in zip(cols["path"], cols["label"])]
    return listing.classes, out


def load_tree(tree: str, sizes: list[int], eval_size: int, eval_tier: int, crop_ratio: float,
              val_fraction: float = 0.0, seed: int = 0, limits: dict[str, int] | None = None) -> dict[str, Any]:
    """An image tree as :func:`tree_samples` lists it, decoded once: per size in ``sizes`` the
    training images resized to that short side, top-left in one (n, H, W, 3) uint8 array padded with each
    image's edge pixels, with their (height, width) in ``hw``; the validation images resized to ``eval_tier``,
    centre-cropped to ``crop_ratio`` of the short side and resized to ``eval_size`` (``val_cropped``)."""
    from lightray.data.images import RESAMPLE, resize_short

    t0 = time.perf_counter()
    classes, samples = tree_samples(tree, val_fraction, seed, limits)
    by_size: dict[int, list[np.ndarray]] = {s: [] for s in sizes}
    short_sides = []
    for path, _label in samples["train"]:
        with Image.open(path) as im:
            img = im.convert("RGB")
        short_sides.append(min(img.size))
        for s in sizes:
            by_size[s].append(np.asarray(resize_short(img, s)))
    out: dict[str, Any] = {"classes": classes, "native_short_side": int(np.median(short_sides)),
                           "train_by_res": {}, "val_cropped": True}
    labels = np.asarray([lab for _p, lab in samples["train"]], np.int64)
    for s, imgs in by_size.items():
        hw = np.asarray([a.shape[:2] for a in imgs], np.int64)
        canvas = np.stack([np.pad(a, ((0, hw[:, 0].max() - a.shape[0]), (0, hw[:, 1].max() - a.shape[1]), (0, 0)),
                                  mode="edge") for a in imgs])
        out["train_by_res"][s] = (canvas, labels, hw)
    crops = []
    for path, _label in samples["val"]:
        with Image.open(path) as im:
            img = resize_short(im.convert("RGB"), eval_tier)
        side = min(img.size) * crop_ratio
        x0, y0 = (img.size[0] - side) / 2, (img.size[1] - side) / 2
        crops.append(np.asarray(img.resize((eval_size, eval_size), RESAMPLE, box=(x0, y0, x0 + side, y0 + side))))
    out["train"] = (out["train_by_res"][max(sizes)][0], labels)
    out["val"] = (np.stack(crops), np.asarray([lab for _p, lab in samples["val"]], np.int64))
    out["decode_s"] = time.perf_counter() - t0
    return out


def random_resized_crop(x: torch.Tensor, size: int, min_scale: float, gen: torch.Generator,
                        hw: np.ndarray | None = None, flip: torch.Tensor | None = None) -> torch.Tensor:
    """Batched random-resized crop (area in [min_scale, 1], aspect in [3/4, 4/3]) and horizontal flip of a float
    NCHW batch, resized to ``size`` by bilinear ``roi_align``. ``hw``: each image's (height, width) where the
    batch holds images of several sizes top-left on one canvas (else every image fills it). ``flip``: the flip
    bits to use (``data.flip=alternate``) instead of a coin each."""
    from torchvision.ops import roi_align

    n = x.shape[0]
    if min_scale >= 1.0 and hw is None and x.shape[2] == x.shape[3] == size:
        # lightray's crop at scale 1 is the whole image (RandomResizedCrop's fallback): only the flip is left
        flip = torch.rand(n, generator=gen) < 0.5 if flip is None else flip
        return torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
    h, w = (torch.full((n,), float(d)) for d in x.shape[2:]) if hw is None else torch.from_numpy(hw).float().T
    area = torch.empty(n).uniform_(min_scale, 1.0, generator=gen) * h * w
    ratio = torch.exp(torch.empty(n).uniform_(float(np.log(3 / 4)), float(np.log(4 / 3)), generator=gen))
    cw = torch.minimum(torch.sqrt(area * ratio), w)
    ch = torch.minimum(torch.sqrt(area / ratio), h)
    x0 = torch.rand(n, generator=gen) * (w - cw)
    y0 = torch.rand(n, generator=gen) * (h - ch)
    boxes = torch.stack([torch.arange(n, dtype=torch.float32), x0, y0, x0 + cw, y0 + ch], 1)
    out = roi_align(x, boxes, output_size=(size, size), spatial_scale=1.0, sampling_ratio=2, aligned=True)
    flip = torch.rand(n, generator=gen) < 0.5 if flip is None else flip
    return torch.where(flip.view(-1, 1, 1, 1), out.flip(3), out)


def center_crop(x: torch.Tensor, size: int, crop_ratio: float) -> torch.Tensor:
    """The centre ``crop_ratio`` of the short side, resized to ``size`` (lightray's validation crop)."""
    from torchvision.ops import roi_align

    n, _, h, w = x.shape
    side = min(h, w) * crop_ratio
    if side == size and h == w == size:
        return x
    x0, y0 = (w - side) / 2, (h - side) / 2
    boxes = torch.tensor([[i, x0, y0, x0 + side, y0 + side] for i in range(n)], dtype=torch.float32)
    return roi_align(x, boxes, output_size=(size, size), spatial_scale=1.0, sampling_ratio=2, aligned=True)


def _normalise(batch: np.ndarray, channels_last: bool) -> torch.Tensor:
    from lightray.train.device import IMAGENET_MEAN, IMAGENET_STD

    x = torch.from_numpy(batch).permute(0, 3, 1, 2).float().div_(255)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    x = (x - mean) / std
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x.contiguous()


@torch.no_grad()
def _top1(model: torch.nn.Module, xs: np.ndarray, ys: np.ndarray, cfg, size: int, cropped: bool,
          precision: str = "fp32", translate: int = 0) -> float:
    """Top-1 with the run's test-time views; ``translate``: the shifted views' pixels (lightray scores them at the
    final validation only)."""
    from lightray.train.device import autocast
    from lightray.train.shift import tta_logits

    model.eval()
    hits = 0
    for lo in range(0, len(xs), 500):
        x = _normalise(xs[lo:lo + 500], False)
        if not cropped:
            x = center_crop(x, size, cfg.data.val_crop_ratio)
        if cfg.model.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with autocast(precision, torch.device("cpu")):
            logits = tta_logits(model, x, cfg.schedule.tta_flip, translate)
        hits += int((logits.argmax(1) == torch.from_numpy(ys[lo:lo + 500])).sum())
    model.train()
    return hits / max(1, len(xs))


def _train_epoch(model, opt, loss_fn, averages: dict[str, Any], sched, ph, arrays: dict[str, Any], perm: np.ndarray,
                 gen: torch.Generator, samples: int, *, cfg, epoch: int, precision: str) -> int:
    """One epoch of phase ``ph`` in the order ``perm``; returns the samples seen after it. ``averages``: the EMA,
    the lookahead and the stem to whiten (each None when off), built by the run's own classes."""
    from lightray.data.augment import alternating_flips
    from lightray.train.device import autocast
    from lightray.train.optim import set_lr_momentum
    from lightray.train.shift import shift_batch
    from lightray.train.whiten import whiten_from

    xtr, ytr = arrays["train"]
    ema, lookahead = averages["ema"], averages["lookahead"]
    for s in range(len(ytr) // ph.batch_size):
        idx = perm[s * ph.batch_size:(s + 1) * ph.batch_size]
        src, hw = xtr, None
        if "train_by_res" in arrays:  # the copy resized for this phase, as lightray reads this phase's tier
            src, _labels, hw = arrays["train_by_res"][ph.resolution]
            hw = hw[idx]
        flip = None
        if cfg.data.flip == "alternate":  # lightray's own alternating bits, by row index as the plain loop's ids
            flip = torch.from_numpy(alternating_flips(gen.initial_seed(), np.full(len(idx), epoch), idx))
        x = random_resized_crop(_normalise(src[idx], False), ph.resolution, ph.min_scale, gen, hw, flip)
        if cfg.model.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x = shift_batch(x, gen.initial_seed(), epoch, idx, cfg.data.translate)
        if averages["stem"] is not None and samples == 0:
            whiten_from(averages["stem"], x)
            for average in (ema, lookahead):
                if average is not None:
                    average.reset(model)
        set_lr_momentum(opt, sched.lr_at(samples), sched.momentum_at(samples))
        with autocast(precision, torch.device("cpu")):
            loss = loss_fn(model(x), torch.from_numpy(ytr[idx]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if ema is not None:
            ema.update(model)
        samples += ph.batch_size
        averages["steps"] += 1
        if lookahead is not None:
            lookahead.after_step(model, averages["steps"], samples / sched.total_samples)
            if samples >= sched.total_samples:
                lookahead.finish(model)
    return samples


def run(cfg, arrays: dict[str, Any], *, targets: list[float], threads: int, seed: int,
        fixed_final: bool = False, label: str = "plain same recipe") -> tuple[list[dict[str, Any]], float]:
    """Train ``cfg`` (a config fitted to the data) over ``arrays`` (:func:`load_arrays` or :func:`load_tree`);
    a record (epoch, val_top1, train_s, wall_s) per validated epoch (``schedule.eval_every_epochs``, as lightray)
    until the highest target or the recipe's epochs, and the start-up seconds (model and optimiser build, the
    decode counted by the caller)."""
    from bench.common import note
    from lightray.schedule import Schedule
    from lightray.train.device import precision_for
    from lightray.train.ema import ModelEMA
    from lightray.train.lookahead import Lookahead
    from lightray.train.model import build_model
    from lightray.train.optim import build_loss, build_optimizer
    from lightray.train.whiten import whitening_stem

    t_start = time.perf_counter()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    xtr, ytr = arrays["train"]
    xva, yva = arrays["val"]
    sched = Schedule(cfg.schedule, cfg.optim, len(xtr))
    model = build_model(cfg.model, len(arrays["classes"]))
    if cfg.model.channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    loss_fn = build_loss(cfg.optim)
    ema = ModelEMA(model, cfg.optim.ema_decay) if cfg.optim.ema_decay > 0 else None
    averages = {"ema": ema, "lookahead": Lookahead(model, cfg.optim.lookahead_every) if cfg.optim.lookahead_every
                else None, "stem": whitening_stem(model) if cfg.model.whiten_stem else None, "steps": 0}
    # The same recipe runs at the precision lightray resolves for it on this CPU (bf16 autocast where the CPU
    # has bf16 in hardware), so the two sides differ in their plumbing only.
    precision = precision_for(cfg.model, torch.device("cpu"))
    final = sched.resolved.phases[-1]
    eval_res = cfg.schedule.eval_resolution or final.resolution
    history: list[dict[str, Any]] = []
    samples = 0
    t_train = time.perf_counter()
    for epoch in range(sched.epochs):
        ph = final if fixed_final else next(p for p in sched.resolved.phases if p.first_epoch <= epoch < p.end_epoch)
        samples = _train_epoch(model, opt, loss_fn, averages, sched, ph, arrays, rng.permutation(len(xtr)), gen,
                               samples, cfg=cfg, epoch=epoch, precision=precision)
        if not sched.validates_after(epoch):  # lightray's evaluation interval (schedule.eval_every_epochs)
            note(f"{label} epoch {epoch + 1}/{sched.epochs} ({ph.resolution}px): not validated "
                 f"({time.perf_counter() - t_train:.0f} s)")
            continue
        top1 = _top1(ema.module if ema is not None else model, xva, yva, cfg, eval_res,
                     arrays.get("val_cropped", False), precision,
                     cfg.schedule.tta_translate if epoch + 1 == sched.epochs else 0)
        now = time.perf_counter()
        history.append({"epoch": epoch + 1, "val_top1": top1, "train_s": now - t_train, "wall_s": now - t_start})
        note(f"{label} epoch {epoch + 1}/{sched.epochs} ({ph.resolution}px): top-1 {top1:.3f} "
             f"({now - t_train:.0f} s)")
        if top1 >= max(targets):
            break
    return history, t_train - t_start
