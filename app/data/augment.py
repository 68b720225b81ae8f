"""uint8 image ops run in Ray Data tasks: random-resized-crop + flip for training, centre crop or
rectangular (aspect-keeping) resize for evaluation.

Random draws come from ``(seed, epoch, sample_id)``, so a sample gets the same crop whichever process,
node or worker count serves it: a resumed run sees exactly the pixels the uninterrupted one would have.
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image


def decode(data: bytes, fmt: str, height: int, width: int) -> Image.Image:
    if fmt == "raw":
        return Image.fromarray(np.frombuffer(data, dtype=np.uint8).reshape(height, width, 3))
    img = Image.open(io.BytesIO(data))
    img.draft("RGB", (width, height))
    return img.convert("RGB") if img.mode != "RGB" else img


def crop_box(rng: np.random.Generator, w: int, h: int, min_scale: float,
             ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[float, float, float, float]:
    """torchvision's RandomResizedCrop box: area scale in [min_scale, 1], aspect in ``ratio``."""
    area = w * h
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(min_scale, 1.0)
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        cw = math.sqrt(target * aspect)
        ch = math.sqrt(target / aspect)
        if 0 < cw <= w and 0 < ch <= h:
            x = rng.uniform(0, w - cw)
            y = rng.uniform(0, h - ch)
            return (x, y, x + cw, y + ch)
    # Fallback: the largest centred box within the ratio range.
    in_ratio = w / h
    if in_ratio < ratio[0]:
        cw, ch = w, w / ratio[0]
    elif in_ratio > ratio[1]:
        cw, ch = h * ratio[1], h
    else:
        cw, ch = w, h
    x, y = (w - cw) / 2, (h - ch) / 2
    return (x, y, x + cw, y + ch)


def train_crop(img: Image.Image, size: int, min_scale: float, rng: np.random.Generator) -> np.ndarray:
    box = crop_box(rng, img.width, img.height, min_scale)
    out = img.resize((size, size), Image.BILINEAR, box=box)
    arr = np.asarray(out)
    if rng.random() < 0.5:
        arr = arr[:, ::-1]
    return arr


def center_crop(img: Image.Image, size: int, crop_ratio: float) -> np.ndarray:
    """Resize the short side to ``size / crop_ratio`` and take the centre ``size`` x ``size``."""
    short = min(img.width, img.height)
    scale = size / crop_ratio / short
    cw, ch = size / scale, size / scale
    x, y = (img.width - cw) / 2, (img.height - ch) / 2
    return np.asarray(img.resize((size, size), Image.BILINEAR, box=(x, y, x + cw, y + ch)))


def rect_target(aspect: float, size: int) -> tuple[int, int]:
    """(width, height) of a rectangular validation batch whose images have mean aspect ``aspect`` (w/h):
    short side ``size``, long side scaled by the aspect with the excess over ``size`` rounded to a
    multiple of 8 (fast.ai's rectangular validation; the shape set stays small), never below ``size``."""
    long = size + max(0, int(round((size * (aspect if aspect >= 1 else 1 / aspect) - size) / 8)) * 8)
    return (long, size) if aspect >= 1 else (size, long)


def rect_crop(img: Image.Image, width: int, height: int) -> np.ndarray:
    """Scale uniformly (aspect kept) until the image covers ``width`` x ``height``, then take the centre:
    only the excess along the long side is cut, unlike the square centre crop."""
    scale = max(width / img.width, height / img.height)
    cw, ch = width / scale, height / scale
    x, y = (img.width - cw) / 2, (img.height - ch) / 2
    return np.asarray(img.resize((width, height), Image.BILINEAR, box=(x, y, x + cw, y + ch)))


def sample_rng(seed: int, epoch: int, sample_id: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, sample_id, 0xA06])
