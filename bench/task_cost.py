"""The CPU work of a Ray Data training task per sample: its crop draws and its crops, against how it did them before.

    python -m bench.task_cost                 # 5 interleaved repeats over 2,048 prepared 32 px photos
    python -m bench.task_cost --size 128 --min-scale 0.35   # an Imagenette-like phase: PIL crops on both sides
    python -m bench.task_cost --quick         # a correctness run of a few seconds

A task turns a block of plan positions into a batch (``lightray.data.task_batches.cpu_batch``). With a 1,024-photo
CIFAR-10 step that work sits on the same two cores as the training step, and a 9-epoch run makes all of it in
its first half minute (Ray Data runs the phase's stream ahead), so its cost shows up as a slow first epoch.

(a) before: the block's draws from one ``numpy.random.default_rng([seed, epoch, id, stream])`` per sample, then a
    PIL crop per sample (``augment.train_crop``), as the task did until 2026-12-07;
(b) now: the real ``cpu_batch``: the same draws computed for the block at once (``lightray.data.pcg_streams``), and
    a crop that is the whole photo at its stored size copied from the stored pixels.

``--path device`` times the device-augmentation task instead (``task_batches.device_batch``: each sample's window
of stored pixels, its box and flip; the GPU crops the batch), the path a GPU cluster's raw tiers take: there the
per-sample work is a copy and the draws are most of it. Its "before" is the same real task with the draws made one
generator at a time (``pcg_streams``' own fallback).

Both sides make the same batch from the same prepared shards (the bench checks it byte for byte before timing).
``figures.us_per_sample`` gives each side's median over the repeats (microseconds of this process's CPU time per
sample, after an untimed repeat of each side, with Python's garbage collected before each timing), and
``figures.draws_us_per_sample`` the draws alone; ``ratios.before_over_now`` is one value per interleaved repeat
with its spread (``resolved`` as in every bench).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import Machine, emit, note, resolved_ratio, spread


def _photos(root: Path, n: int, size: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size].astype(np.float64) / size
    for label in ("a", "b"):
        (root / "train" / label).mkdir(parents=True)
        (root / "val" / label).mkdir(parents=True)
    for i in range(n):
        f = rng.uniform(1, 6, 3)
        img = np.stack([120 + 80 * np.sin(6.28 * f[c] * x + c) * np.cos(6.28 * f[c] * y) for c in range(3)], -1)
        split = "val" if i < 8 else "train"
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(root / split / "ab"[i % 2] / f"{i}.png")


@contextlib.contextmanager
def numpy_generators() -> Iterator[None]:
    """Draws made as before: ``pcg_streams``' own fallback, one numpy generator per sample."""
    from lightray.data import pcg_streams

    was, pcg_streams._checked = pcg_streams._checked, False
    try:
        yield
    finally:
        pcg_streams._checked = was


def before(spec: Any, phase: int, epochs: np.ndarray, shard_idx: np.ndarray, rows: np.ndarray) -> dict:
    """The task's CPU path as it was: a generator per sample for the draws, a PIL crop per sample."""
    from lightray.data import augment

    ph = spec.phases[phase]
    heights, widths, labels, ids = ph.shards.meta(spec.local_dir, shard_idx, rows)
    with numpy_generators():
        boxes, flips = augment.draw_crops(spec.seed, epochs, ids, heights, widths, ph.min_scale, spec.flip)
    out = np.empty((len(ids), ph.resolution, ph.resolution, 3), np.uint8)
    for i, (img, _label, _sid) in enumerate(ph.shards.images(spec.local_dir, shard_idx, rows)):
        out[i] = augment.train_crop(img, ph.resolution, boxes[i], bool(flips[i]))
    return {"image": out, "label": labels, "sample_id": ids}


def before_device(spec: Any, phase: int, epochs: np.ndarray, shard_idx: np.ndarray, rows: np.ndarray) -> dict:
    """The device path's task as it was: the real task, its draws made one generator per sample."""
    from lightray.data import task_batches

    with numpy_generators():
        return task_batches.device_batch(spec, spec.phases[phase], epochs, shard_idx, rows)


def _spec(args: argparse.Namespace, tmp: Path) -> Any:
    """The phase's spec over ``args.photos`` generated photos prepared (stored raw) in ``tmp``."""
    import ray

    from lightray.data.ingest import IngestSpec, PhaseSpec, plan_augmentation, tier_shards
    from lightray.data.manifest import Manifest
    from lightray.data.prepare import prepare

    note(f"writing {args.photos} photos of {args.size} px and preparing them (stored raw)")
    _photos(tmp / "src", args.photos, args.size)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        m = Manifest.load(str(prepare(str(tmp / "src"), str(tmp / "cache"), [args.size],
                                      raw_max_resolution=args.size, shard_rows=512)))
    finally:
        ray.shutdown()
    spec = IngestSpec(seed=0, local_dir=str(tmp / "local"), train_size=m.num_samples("train"),
                      phases=[PhaseSpec(0, args.size, args.batch, args.min_scale, 0, 1,
                                        tier_shards(m, "train", args.size))],
                      val=tier_shards(m, "val", args.size), eval_resolution=args.size, val_crop_ratio=1.0)
    if args.path == "device":
        plan_augmentation(spec, "device", False)
    return spec


def _blocks(spec: Any, batch: int, epochs: int = 3) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(epochs, shard indices, rows) of every whole batch of ``epochs`` epochs, in the run's order."""
    from lightray.data.plan import EpochPlan

    plan = EpochPlan(spec.phases[0].shards.rows, spec.seed)
    blocks = []
    for epoch in range(epochs):
        order = plan.order(epoch)
        for s in range(0, len(order) - batch + 1, batch):
            shard_idx, rows = plan.to_shard_row(order[s:s + batch])
            blocks.append((np.full(len(rows), epoch, np.int64), np.asarray(shard_idx, np.int64),
                           np.asarray(rows, np.int64)))
    return blocks


def _interleaved(blocks: list, sides: dict[str, Any], draws: dict[str, Any], repeats: int) -> dict[str, list[float]]:
    """Per repeat, each side's and its draws' CPU microseconds per sample, the order alternating."""
    samples = sum(len(b[2]) for b in blocks)

    def timed(fn: Any) -> float:
        gc.collect()  # one side's garbage (a generator object per sample, before) is not collected on the other's clock
        t = time.process_time()
        for b in blocks:
            fn(b)
        return (time.process_time() - t) / samples * 1e6

    got: dict[str, list[float]] = {k: [] for k in ("before", "now", "draws_before", "draws_now")}
    for side in ("before", "now"):  # an untimed repeat of each side first
        timed(sides[side])
        timed(draws[side])
    for rep in range(repeats):
        for side in (("before", "now") if rep % 2 == 0 else ("now", "before")):
            got[side].append(timed(sides[side]))
            got[f"draws_{side}"].append(timed(draws[side]))
        note(f"repeat {rep + 1}/{repeats}: before {got['before'][-1]:.1f} us a sample, now "
             f"{got['now'][-1]:.1f} (draws {got['draws_before'][-1]:.1f} -> {got['draws_now'][-1]:.1f})")
    return got


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--photos", type=int, default=2048)
    ap.add_argument("--size", type=int, default=32, help="the photos' and the crop's side in px")
    ap.add_argument("--min-scale", type=float, default=1.0, help="1.0: every crop is the whole photo (CIFAR-10)")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--path", choices=("cpu", "device"), default="cpu")
    ap.add_argument("--quick", action="store_true", help="a correctness run: 300 photos, batches of 64, 2 repeats")
    args = ap.parse_args(argv)
    if args.quick:
        args.photos, args.batch, args.repeats = 300, 64, 2
    machine = Machine()

    from lightray.data import augment, task_batches

    spec = _spec(args, Path(tempfile.mkdtemp(prefix="task_cost-")))
    ph = spec.phases[0]
    blocks = _blocks(spec, args.batch)
    old_task = before_device if args.path == "device" else before
    new_task = task_batches.device_batch if args.path == "device" else task_batches.cpu_batch
    for b in blocks:  # the same batch both ways, and the shards' copies made before any timing
        a, n = old_task(spec, 0, *b), new_task(spec, ph, *b)
        assert all(np.array_equal(a[k], n[k]) for k in a), "the two sides made different batches"

    def ids(b: tuple) -> np.ndarray:
        return ph.shards.meta(spec.local_dir, b[1], b[2])[3]

    def before_draws(epochs: np.ndarray, sample_ids: np.ndarray) -> np.ndarray:
        with numpy_generators():
            return augment.sample_uniforms(0, epochs, sample_ids, augment._DRAWS)

    got = _interleaved(
        blocks, {"before": lambda b: old_task(spec, 0, *b), "now": lambda b: new_task(spec, ph, *b)},
        {"before": lambda b: before_draws(b[0], ids(b)),
         "now": lambda b: augment.sample_uniforms(0, b[0], ids(b), augment._DRAWS)}, args.repeats)
    side = np.full(len(blocks[0][0]), args.size)
    boxes0, _ = augment.draw_crops(0, blocks[0][0], np.arange(len(side)), side, side, args.min_scale)
    # which CPU path "now" took (the device path always ships windows)
    copies = args.path == "cpu" and bool(augment.copies_whole(boxes0, side, side, args.size).all())
    figures = {"path": args.path, "samples_per_repeat": sum(len(b[2]) for b in blocks), "photo_px": args.size,
               "min_scale": args.min_scale, "whole_photo_copies": copies,
               "us_per_sample": {"before": spread(got["before"], 2), "now": spread(got["now"], 2)},
               "draws_us_per_sample": {"before": spread(got["draws_before"], 2), "now": spread(got["draws_now"], 2)}}
    ratios = {"before_over_now": resolved_ratio([b / n for b, n in zip(got["before"], got["now"])]),
              "draws_before_over_now": resolved_ratio([b / n for b, n in zip(got["draws_before"], got["draws_now"])])}
    return emit("task_cost", figures, ratios, machine.finish(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
