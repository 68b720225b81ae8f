"""The embedded demo dataset: synthetic shapes on cluttered backgrounds, written as real JPEG files.

Ten classes are ten shapes; colour, size, position, rotation, background texture and clutter are all
random and shared by every class, so a model has to learn shape (a CNN's job) rather than colour.
Images come in varied sizes and aspect ratios, like ImageNet's. Every image is drawn from its own
seed ``(seed, split, class, index)``, so the same seed gives the same bytes on any machine with the
same Pillow, and generation parallelises trivially.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from lightray.config import DataConfig

SHAPES = ("circle", "ring", "triangle", "square", "plus", "cross", "star", "crescent", "pair", "arrow",
          "hexagon", "heart")
# Shapes keep their orientation up to a small jitter: a plus turned by 45 degrees would be a cross.
ROTATION_JITTER = 0.3  # radians
MARKER = "demo.json"


def _polygon(cx: float, cy: float, r: float, n: int, rot: float, inner: float | None = None) -> list[tuple]:
    pts = []
    steps = n * 2 if inner else n
    for i in range(steps):
        rad = r if (inner is None or i % 2 == 0) else r * inner
        a = rot + 2 * math.pi * i / steps
        pts.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
    return pts


def _rotated(points: list[tuple], cx: float, cy: float, rot: float) -> list[tuple]:
    c, s = math.cos(rot), math.sin(rot)
    return [(cx + (x - cx) * c - (y - cy) * s, cy + (x - cx) * s + (y - cy) * c) for x, y in points]


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, rot: float,
               color: tuple, bg: tuple) -> None:
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)
    elif shape == "ring":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)
        draw.ellipse([cx - r * 0.55, cy - r * 0.55, cx + r * 0.55, cy + r * 0.55], fill=bg)
    elif shape == "triangle":
        draw.polygon(_polygon(cx, cy, r, 3, rot - math.pi / 2), fill=color)
    elif shape == "square":
        draw.polygon(_polygon(cx, cy, r, 4, rot + math.pi / 4), fill=color)
    elif shape in ("plus", "cross"):
        w = r * 0.3
        arms = [(cx - r, cy - w), (cx + r, cy - w), (cx + r, cy + w), (cx - r, cy + w)]
        base = rot + (math.pi / 4 if shape == "cross" else 0.0)
        draw.polygon(_rotated(arms, cx, cy, base), fill=color)
        draw.polygon(_rotated(arms, cx, cy, base + math.pi / 2), fill=color)
    elif shape == "star":
        draw.polygon(_polygon(cx, cy, r, 5, rot - math.pi / 2, inner=0.42), fill=color)
    elif shape == "hexagon":
        draw.polygon(_polygon(cx, cy, r, 6, rot), fill=color)
    elif shape == "crescent":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)
        ox, oy = cx + r * 0.45 * math.cos(rot), cy + r * 0.45 * math.sin(rot)
        draw.ellipse([ox - r * 0.85, oy - r * 0.85, ox + r * 0.85, oy + r * 0.85], fill=bg)
    elif shape == "pair":
        d = r * 0.55
        for sgn in (-1, 1):
            px, py = cx + sgn * d * math.cos(rot), cy + sgn * d * math.sin(rot)
            draw.ellipse([px - r * 0.4, py - r * 0.4, px + r * 0.4, py + r * 0.4], fill=color)
    elif shape == "arrow":
        pts = [(cx - r, cy - r * 0.2), (cx + r * 0.1, cy - r * 0.2), (cx + r * 0.1, cy - r * 0.6), (cx + r, cy),
               (cx + r * 0.1, cy + r * 0.6), (cx + r * 0.1, cy + r * 0.2), (cx - r, cy + r * 0.2)]
        draw.polygon(_rotated(pts, cx, cy, rot), fill=color)
    elif shape == "heart":
        s = r * 0.5
        draw.ellipse([cx - 2 * s, cy - 1.5 * s, cx, cy + 0.5 * s], fill=color)
        draw.ellipse([cx, cy - 1.5 * s, cx + 2 * s, cy + 0.5 * s], fill=color)
        draw.polygon([(cx - 1.95 * s, cy - 0.3 * s), (cx + 1.95 * s, cy - 0.3 * s), (cx, cy + 2 * s)], fill=color)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def _random_color(rng: np.random.Generator) -> tuple:
    return tuple(int(v) for v in rng.integers(0, 256, 3))


def _far_color(rng: np.random.Generator, bg: tuple) -> tuple:
    # A shape colour with enough contrast to the background to stay visible after JPEG.
    for _ in range(20):
        c = _random_color(rng)
        if sum(abs(a - b) for a, b in zip(c, bg)) > 180:
            return c
    return tuple(255 - v for v in bg)


def render_image(seed: int, split: str, label: int, index: int, shapes: tuple = SHAPES) -> Image.Image:
    """One demo image, fully determined by its arguments."""
    split_id = {"train": 1, "val": 2}.get(split, 3)
    rng = np.random.default_rng([seed, split_id, label, index])
    w = int(rng.integers(72, 176))
    h = int(np.clip(w * math.exp(rng.uniform(-0.45, 0.45)), 64, 200))
    bg = _random_color(rng)
    # Background texture: smooth random noise around the background colour.
    noise = rng.normal(0, 16, size=(max(2, h // 8), max(2, w // 8), 3))
    tex = Image.fromarray(np.clip(np.array(bg) + noise, 0, 255).astype(np.uint8)).resize((w, h), Image.BILINEAR)
    draw = ImageDraw.Draw(tex)
    # Clutter: lines and dots in random colours that belong to no class.
    for _ in range(int(rng.integers(1, 5))):
        x0, y0, x1, y1 = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(0, w), rng.uniform(0, h)
        draw.line([(x0, y0), (x1, y1)], fill=_random_color(rng), width=int(rng.integers(1, 3)))
    for _ in range(int(rng.integers(0, 5))):
        x, y, rr = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(1.5, 4)
        draw.ellipse([x - rr, y - rr, x + rr, y + rr], fill=_random_color(rng))
    r = rng.uniform(0.28, 0.42) * min(w, h)
    cx = rng.uniform(r + 2, w - r - 2)
    cy = rng.uniform(r + 2, h - r - 2)
    rot = rng.uniform(-ROTATION_JITTER, ROTATION_JITTER)
    draw_shape(draw, shapes[label], cx, cy, r, rot, _far_color(rng, bg), bg)
    if rng.random() < 0.3:
        tex = tex.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.3, 1.0))))
    return tex


def _write_one(args: tuple) -> None:
    root, seed, split, label, index, quality, classes = args
    img = render_image(seed, split, label, index, classes)
    path = os.path.join(root, split, classes[label], f"{classes[label]}_{index:05d}.jpg")
    img.save(path, format="JPEG", quality=quality)


def _jobs(root: str, seed: int, classes: tuple[str, ...], train_per_class: int, val_per_class: int,
          quality: int) -> list[tuple]:
    return [(root, seed, split, label, i, quality, classes)
            for split, n in (("train", train_per_class), ("val", val_per_class))
            for label in range(len(classes)) for i in range(n)]


def _write_share(spec: dict) -> None:
    """A writer process's part: every ``shares``-th image from ``share`` on."""
    jobs = _jobs(spec["root"], spec["seed"], tuple(spec["classes"]), spec["train_per_class"],
                 spec["val_per_class"], spec["quality"])
    for job in jobs[spec["share"]::spec["shares"]]:
        _write_one(job)


# A writer is a fresh interpreter started by its module, not a multiprocessing child: the caller is often a Ray
# driver or worker, whose gRPC and core-worker threads a fork copies mid-flight (a forked writer crashed with
# SIGSEGV in Ray's signal handler, CI 2026-12-07), and multiprocessing's spawn would import the caller's main
# script again in every writer, which a script without an ``if __name__ == "__main__"`` guard cannot survive.
_WRITER = ("import json, sys; spec = json.loads(sys.argv[1]); sys.path[:0] = spec.pop('sys_path'); "
           "from lightray.data.demo import _write_share; _write_share(spec)")


def generate_demo(root: str | os.PathLike, *, seed: int = 0, num_classes: int = 10, train_per_class: int = 320,
                  val_per_class: int = 60, quality: int = 90, processes: int | None = None) -> pathlib.Path:
    """Write the demo ImageFolder tree (``train/<class>/*.jpg``, ``val/<class>/*.jpg``) under ``root``."""
    if not 2 <= num_classes <= len(SHAPES):
        raise ValueError(f"data.demo_classes: bad value {num_classes}; expected 2..{len(SHAPES)}")
    root = pathlib.Path(root)
    classes = SHAPES[:num_classes]
    for split in ("train", "val"):
        for name in classes:
            (root / split / name).mkdir(parents=True, exist_ok=True)
    spec = {"root": str(root), "seed": seed, "classes": list(classes), "train_per_class": train_per_class,
            "val_per_class": val_per_class, "quality": quality}
    procs = processes or min(4, os.cpu_count() or 1)
    if procs == 1:
        _write_share({**spec, "share": 0, "shares": 1})
        return root
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER,
                                 json.dumps({**spec, "share": k, "shares": procs, "sys_path": sys.path})],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
               for k in range(procs)]
    errors = [w.communicate()[1] for w in writers]
    failed = [(w.returncode, err) for w, err in zip(writers, errors) if w.returncode]
    if failed:
        raise RuntimeError(f"demo: writing {root} failed in {len(failed)} of {procs} writer processes; "
                           f"the first (exit {failed[0][0]}): {failed[0][1].strip()[-2000:]}")
    return root


def demo_params(cfg: DataConfig) -> dict:
    return {"seed": cfg.demo_seed, "num_classes": cfg.demo_classes, "train_per_class": cfg.demo_train_per_class,
            "val_per_class": cfg.demo_val_per_class, "version": 2}


def ensure_demo(root: str | os.PathLike, cfg: DataConfig) -> str:
    """Create the demo tree under ``root/<params hash>`` once; later calls return the same path."""
    params = demo_params(cfg)
    tag = "demo-s{seed}-c{num_classes}-t{train_per_class}-v{val_per_class}-v{version}".format(**params)
    target = pathlib.Path(root) / tag
    if (target / MARKER).is_file():
        return str(target)
    tmp = pathlib.Path(root) / f".{tag}.tmp{os.getpid()}"
    generate_demo(tmp, seed=params["seed"], num_classes=params["num_classes"],
                  train_per_class=params["train_per_class"], val_per_class=params["val_per_class"])
    (tmp / MARKER).write_text(json.dumps(params))
    try:
        tmp.rename(target)  # atomic: a half-written tree is never taken for the demo
    except OSError:
        if not (target / MARKER).is_file():
            raise
    return str(target)
