"""uint8 image ops run in Ray Data tasks: random-resized-crop + flip for training, centre crop or
rectangular (aspect-keeping) resize for evaluation.

Random draws come from ``(seed, epoch, sample_id)`` (:func:`draw_crops`, a block at a time), so a sample gets
the same crop whichever process, node or worker count serves it: a resumed run sees exactly the pixels the
uninterrupted one would have.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import numpy as np
from PIL import Image

from lightray.data import pcg_streams
from lightray.data.sample_hash import hashed_uniforms


def decode(data: bytes, fmt: str, height: int, width: int) -> Image.Image:
    if fmt == "raw":
        return Image.fromarray(np.frombuffer(data, dtype=np.uint8).reshape(height, width, 3))
    img = Image.open(io.BytesIO(data))
    img.draft("RGB", (width, height))
    return img.convert("RGB") if img.mode != "RGB" else img


# --- the random draws of a training sample -----------------------------------------------------------------
# Every draw is a pure function of (seed, epoch, sample id, draw index): each sample's uniforms come from its own
# numpy generator seeded with (seed, epoch, id), and torchvision's box arithmetic then runs for the whole block
# in float64 numpy. The CPU path, the device path and the calibration all take their boxes from
# :func:`draw_crops`, so they agree. Built one at a time the generators cost about 12 us a sample;
# :mod:`lightray.data.pcg_streams` computes the same streams for the whole block at once (about 2 us a sample), bit
# for bit. (A counter-based hash instead was tried once: with it the class-sorted Parquet smoke run,
# tests/test_source_order.py, trained to 66.7% top-1 instead of 100%, for a reason not found.)
CROP_TRIES = 10  # torchvision's RandomResizedCrop tries this many (area, aspect) pairs before its fallback
RATIO = (3 / 4, 4 / 3)
_DRAWS = 2 * CROP_TRIES + 3  # per try: area scale, log-aspect; then x, y and the flip
_STREAM = 0xA06  # keeps these draws apart from any other use of the same (seed, epoch, id)


def sample_uniforms(seed: int, epochs: np.ndarray, ids: np.ndarray, k: int) -> np.ndarray:
    """(n, k) float64 uniforms in [0, 1): draw ``j`` of sample ``i`` depends only on (seed, epochs[i], ids[i], j)."""
    epochs, ids = np.atleast_1d(np.asarray(epochs, np.int64)), np.atleast_1d(np.asarray(ids, np.int64))
    # Row i is np.random.default_rng([seed, epochs[i], ids[i], _STREAM]).random(k), computed for the block at once.
    return pcg_streams.uniforms([seed, epochs, ids, _STREAM], k)


def crop_boxes(u: np.ndarray, heights: np.ndarray, widths: np.ndarray, min_scale: float,
               ratio: tuple[float, float] = RATIO) -> np.ndarray:
    """(n, 4) float64 boxes (x0, y0, x1, y1) of torchvision's RandomResizedCrop for images of these sizes: area
    scale in [min_scale, 1], aspect log-uniform in ``ratio``, the first of :data:`CROP_TRIES` tries that fits,
    else the largest centred box within the ratio range. ``u``: each sample's uniforms (:func:`sample_uniforms`)."""
    h = np.asarray(heights, np.float64)
    w = np.asarray(widths, np.float64)
    n = len(h)
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    target = (w * h)[:, None] * (min_scale + (1.0 - min_scale) * u[:, 0:2 * CROP_TRIES:2])
    aspect = np.exp(log_lo + (log_hi - log_lo) * u[:, 1:2 * CROP_TRIES:2])
    cw, ch = np.sqrt(target * aspect), np.sqrt(target / aspect)
    fits = (cw <= w[:, None]) & (ch <= h[:, None])
    first = fits.argmax(axis=1)
    found = fits[np.arange(n), first]
    cw, ch = cw[np.arange(n), first], ch[np.arange(n), first]
    # The fallback: the largest centred box within the ratio range.
    in_ratio = w / np.maximum(h, 1e-300)
    fw = np.where(in_ratio > ratio[1], h * ratio[1], w)
    fh = np.where(in_ratio < ratio[0], w / ratio[0], h)
    cw, ch = np.where(found, cw, fw), np.where(found, ch, fh)
    x = np.where(found, u[:, 2 * CROP_TRIES] * (w - cw), (w - cw) / 2)
    y = np.where(found, u[:, 2 * CROP_TRIES + 1] * (h - ch), (h - ch) / 2)
    return np.stack([x, y, x + cw, y + ch], axis=1)


def draw_crops(seed: int, epochs: np.ndarray, ids: np.ndarray, heights: np.ndarray, widths: np.ndarray,
               min_scale: float, flip: str = "random") -> tuple[np.ndarray, np.ndarray]:
    """((n, 4) float64 crop boxes in stored-image pixels, (n,) flips) of every sample of a block at once, each
    from its own (seed, epoch, sample id): what the CPU path (:func:`train_crop`), the device path
    (:func:`copy_windows`) and device decode crop. ``flip``: ``data.flip`` (:func:`choose_flips`)."""
    ids = np.atleast_1d(np.asarray(ids, np.int64))
    if len(ids) == 0:
        return np.zeros((0, 4), np.float64), np.zeros(0, bool)
    epochs = np.broadcast_to(np.asarray(epochs, np.int64), ids.shape)
    u = sample_uniforms(seed, epochs, ids, _DRAWS)
    return crop_boxes(u, heights, widths, min_scale), choose_flips(flip, seed, epochs, ids, u[:, -1] < 0.5)


FLIPS = ("random", "alternate")
_FLIP_STREAM = 0xF11


def alternating_flips(seed: int, epochs: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """(n,) flip bits of ``data.flip=alternate`` (airbench's alternating flip): a sample's mirror in even epochs
    is a hashed coin of (seed, sample id), and odd epochs show it the other way. Over any two epochs every image
    is seen both ways, where independent coins repeat one side half the time; it pays most in short runs."""
    ids = np.atleast_1d(np.asarray(ids, np.int64))
    epochs = np.broadcast_to(np.asarray(epochs, np.int64), ids.shape)
    first = hashed_uniforms(seed, _FLIP_STREAM, np.zeros_like(ids), ids, 1)[:, 0] < 0.5
    return first ^ (epochs % 2 == 1)


def choose_flips(flip: str, seed: int, epochs: np.ndarray, ids: np.ndarray, drawn: np.ndarray) -> np.ndarray:
    """The flip bits for ``data.flip``: ``drawn`` (each sample's own coin per epoch) or the alternating ones."""
    if flip == "random":
        return drawn
    if flip == "alternate":
        return alternating_flips(seed, epochs, ids)
    raise ValueError(f"data.flip: bad value {flip!r}; expected one of {', '.join(FLIPS)}")


def copies_whole(boxes: np.ndarray, heights: np.ndarray, widths: np.ndarray, size: int) -> np.ndarray:
    """(n,) bool: the crop box is the whole stored image and the image is already ``size`` x ``size``, so
    :func:`train_crop` is a copy (PIL's resize returns one): 32 px CIFAR photos at ``min_scale`` 1, say."""
    b = np.asarray(boxes, np.float64).reshape(-1, 4)
    h, w = np.asarray(heights), np.asarray(widths)
    return (b[:, 0] == 0) & (b[:, 1] == 0) & (b[:, 2] == w) & (b[:, 3] == h) & (h == size) & (w == size)


def train_crop(img: Image.Image, size: int, box: Sequence[float], flip: bool) -> np.ndarray:
    """The CPU path's crop: ``box`` of ``img`` resized to ``size`` x ``size`` (bilinear), flipped if ``flip``."""
    arr = np.asarray(img.resize((size, size), Image.BILINEAR, box=tuple(float(v) for v in box)))
    return arr[:, ::-1] if flip else arr


# --- the device path's CPU side: a window copy, the crop itself runs batched on the worker's device ---------
# A crop box's aspect is within [3/4, 4/3] and its sides never exceed the image's, both in crop_boxes' tries and
# in its fallback (torchvision's RandomResizedCrop), so its width is at most min(w, h * 4/3) and its height
# min(h, w * 4/3). (That also implies the old sqrt(area * 4/3) bound: min(w, 4h/3) <= sqrt(w * 4h/3).) The
# window adds one pixel each side for bilinear's neighbours plus the rounding outwards, ceil(box side) + 3 at
# most, so the margin of 4 over ceil(side bound) holds even when float rounding puts a box an ulp past 4/3.
WINDOW_MARGIN = 4
RATIO_HI = 4 / 3


def window_bound(height: int, width: int, ratio_hi: float = RATIO_HI) -> tuple[int, int]:
    """The largest (h, w) window :func:`crop_window` copies from an image of this size: an extreme-aspect image
    (a 288 x 2000 panorama) gives a window about as wide as its short side * 4/3, not sqrt(its area * 4/3)."""
    return (min(height, math.ceil(width * ratio_hi) + WINDOW_MARGIN),
            min(width, math.ceil(height * ratio_hi) + WINDOW_MARGIN))


def canvas_for(heights: np.ndarray, widths: np.ndarray) -> tuple[int, int]:
    """One (h, w) canvas that holds any sample's window, plus a row and column for the edge copy: every batch
    of a phase has this shape, so Ray Data re-batches across blocks and the model sees one input shape.
    The same bound as :func:`window_bound`, over many images at once (the same float products and ceilings)."""
    if len(heights) == 0:
        return 1, 1
    h = np.asarray(heights, dtype=np.int64)
    w = np.asarray(widths, dtype=np.int64)
    bh = np.minimum(h, np.ceil(w.astype(np.float64) * RATIO_HI).astype(np.int64) + WINDOW_MARGIN)
    bw = np.minimum(w, np.ceil(h.astype(np.float64) * RATIO_HI).astype(np.int64) + WINDOW_MARGIN)
    return int(bh.max()) + 1, int(bw.max()) + 1


def window_boxes(boxes: np.ndarray, heights: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """(n, 4) int64 windows (x0, y0, x1, y1, exclusive ends) around (n, 4) crop boxes of images of these sizes:
    one pixel past the box's floor/ceil each side, clipped to the image. The same arithmetic as
    :func:`crop_window` (floor/ceil of the same float64 values), for a whole batch."""
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    h = np.asarray(heights, dtype=np.int64)
    w = np.asarray(widths, dtype=np.int64)
    out = np.empty((len(b), 4), np.int64)
    out[:, 0] = np.maximum(0, np.floor(b[:, 0]).astype(np.int64) - 1)
    out[:, 1] = np.maximum(0, np.floor(b[:, 1]).astype(np.int64) - 1)
    out[:, 2] = np.minimum(w, np.ceil(b[:, 2]).astype(np.int64) + 1)
    out[:, 3] = np.minimum(h, np.ceil(b[:, 3]).astype(np.int64) + 1)
    return out


def crop_window(pixels: np.ndarray, box: tuple[float, float, float, float], out: np.ndarray) -> np.ndarray:
    """Copy the integer window around ``box`` from ``pixels`` (HWC uint8) into ``out`` (the zeroed canvas,
    top-left aligned) and return the box in ``out``'s coordinates (same fractional parts: the same crop).

    The row and column after the window repeat its last ones, so a bilinear sample at the image's last half
    pixel sees the edge pixel twice (PIL's clamp) rather than the zero padding. One image at a time; a
    block's samples go through :func:`copy_windows`, which gives the same canvases."""
    h, w = pixels.shape[:2]
    x0, y0, x1, y1 = box
    wx0, wy0 = max(0, math.floor(x0) - 1), max(0, math.floor(y0) - 1)
    wx1, wy1 = min(w, math.ceil(x1) + 1), min(h, math.ceil(y1) + 1)
    ww, wh = wx1 - wx0, wy1 - wy0
    out[:wh, :ww] = pixels[wy0:wy1, wx0:wx1]
    out[:wh, ww] = out[:wh, ww - 1]
    out[wh, :ww + 1] = out[wh - 1, :ww + 1]
    return np.array([x0 - wx0, y0 - wy0, x1 - wx0, y1 - wy0], dtype=np.float32)


def copy_windows(pixels: list[np.ndarray], boxes: np.ndarray, out: np.ndarray) -> np.ndarray:
    """:func:`crop_window` of every sample at once: ``pixels[i]``'s window around ``boxes[i]`` into ``out[i]``
    (zeroed (n, H, W, 3) canvases); returns the (n, 4) float32 boxes in canvas coordinates.

    The windows come from one vectorised computation; each image then takes three slice copies (its window,
    the column and the row after it). Images differ in size, so no single gather covers them without copying
    whole canvas rows past each window, and fancy-indexed edge copies over the whole batch touch every canvas
    row, where these slices touch only the window's."""
    n = len(pixels)
    if n == 0:
        return np.zeros((0, 4), np.float32)
    heights = np.fromiter((p.shape[0] for p in pixels), np.int64, n)
    widths = np.fromiter((p.shape[1] for p in pixels), np.int64, n)
    wins = window_boxes(boxes, heights, widths)
    for px, canvas, (x0, y0, x1, y1) in zip(pixels, out, wins.tolist()):
        ww, wh = x1 - x0, y1 - y0
        canvas[:wh, :ww] = px[y0:y1, x0:x1]
        canvas[:wh, ww] = canvas[:wh, ww - 1]
        canvas[wh, :ww + 1] = canvas[wh - 1, :ww + 1]
    return (np.asarray(boxes, np.float64) - wins[:, [0, 1, 0, 1]]).astype(np.float32)


def device_windows(pixels: list[np.ndarray], seed: int, epochs: np.ndarray, ids: np.ndarray, min_scale: float,
                   canvas: tuple[int, int], flip: str = "random") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The device path's task work for a block: (uint8 (n, *canvas, 3) windows, float32 (n, 4) boxes in canvas
    pixels, (n,) flips), every draw from (seed, epoch, sample id) as the CPU path draws it."""
    n = len(pixels)
    heights = np.fromiter((p.shape[0] for p in pixels), np.int64, n)
    widths = np.fromiter((p.shape[1] for p in pixels), np.int64, n)
    boxes, flips = draw_crops(seed, epochs, ids, heights, widths, min_scale, flip)
    images = np.zeros((n, *canvas, 3), np.uint8)
    return images, copy_windows(pixels, boxes, images), flips


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
