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


def draw_crop(rng: np.random.Generator, w: int, h: int, min_scale: float) -> tuple[tuple[float, float, float, float],
                                                                                   bool]:
    """(crop box in stored-image pixels, horizontal flip): the draws of one training sample, in the order both
    the CPU path (:func:`train_crop`) and the device path (:func:`crop_window`) consume them."""
    box = crop_box(rng, w, h, min_scale)
    return box, bool(rng.random() < 0.5)


def train_crop(img: Image.Image, size: int, min_scale: float, rng: np.random.Generator) -> np.ndarray:
    box, flip = draw_crop(rng, img.width, img.height, min_scale)
    arr = np.asarray(img.resize((size, size), Image.BILINEAR, box=box))
    return arr[:, ::-1] if flip else arr


# --- the device path's CPU side: a window copy, the crop itself runs batched on the worker's device ---------
# A crop box's sides are at most sqrt(area * 4/3) (aspect within [3/4, 4/3], scale <= 1) and never more than
# the image's; the window adds one pixel each side for bilinear's neighbours plus the rounding outwards.
WINDOW_MARGIN = 4


def window_bound(height: int, width: int, ratio_hi: float = 4 / 3) -> tuple[int, int]:
    """The largest (h, w) window :func:`crop_window` copies from an image of this size."""
    side = math.ceil(math.sqrt(height * width * ratio_hi)) + WINDOW_MARGIN
    return min(height, side), min(width, side)


def canvas_for(heights: np.ndarray, widths: np.ndarray) -> tuple[int, int]:
    """One (h, w) canvas that holds any sample's window, plus a row and column for the edge copy: every batch
    of a phase has this shape, so Ray Data re-batches across blocks and the model sees one input shape."""
    if len(heights) == 0:
        return 1, 1
    side = np.ceil(np.sqrt(heights.astype(np.float64) * widths * (4 / 3))) + WINDOW_MARGIN
    return int(np.minimum(heights, side).max()) + 1, int(np.minimum(widths, side).max()) + 1


def crop_window(pixels: np.ndarray, box: tuple[float, float, float, float], out: np.ndarray) -> np.ndarray:
    """Copy the integer window around ``box`` from ``pixels`` (HWC uint8) into ``out`` (the zeroed canvas,
    top-left aligned) and return the box in ``out``'s coordinates (same fractional parts: the same crop).

    The row and column after the window repeat its last ones, so a bilinear sample at the image's last half
    pixel sees the edge pixel twice (PIL's clamp) rather than the zero padding."""
    h, w = pixels.shape[:2]
    x0, y0, x1, y1 = box
    wx0, wy0 = max(0, math.floor(x0) - 1), max(0, math.floor(y0) - 1)
    wx1, wy1 = min(w, math.ceil(x1) + 1), min(h, math.ceil(y1) + 1)
    ww, wh = wx1 - wx0, wy1 - wy0
    out[:wh, :ww] = pixels[wy0:wy1, wx0:wx1]
    out[:wh, ww] = out[:wh, ww - 1]
    out[wh, :ww + 1] = out[wh - 1, :ww + 1]
    return np.array([x0 - wx0, y0 - wy0, x1 - wx0, y1 - wy0], dtype=np.float32)


def resolve_augment_on(want: str, workers_use_cuda: bool) -> tuple[str, str]:
    """(``cpu`` | ``device``, why) for ``data.augment_on``: ``auto`` is the device on GPU workers (the CPUs'
    work per image becomes a copy) and the CPU otherwise (there the crop runs on the same cores either way)."""
    if want == "cpu":
        return "cpu", "data.augment_on=cpu"
    if want == "device":
        return "device", "data.augment_on=device" + ("" if workers_use_cuda else "; the workers' device is the CPU")
    if workers_use_cuda:
        return "device", "data.augment_on=auto and the workers use CUDA"
    return "cpu", "data.augment_on=auto and the workers have no GPU"


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
