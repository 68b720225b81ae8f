"""Translate augmentation (``data.translate``) and translated test-time views (``schedule.tta_translate``), after
the fast CIFAR-10 trainers (airbench94, hlb-cifar10).

Training: every image moves by up to ``r`` pixels each way, its edges reflected into the gap, on the device after
the crop (so it composes with either augmentation path). At 32 px a random-resized crop throws away a third of a
small photo; a shift of 2 px keeps all of it and still stops the network from learning positions. Each image's
shift comes from (seed, epoch, sample id), like its crop , so a resumed
run shifts the same images the same way.

Validation: the mean of the image's logits and of the image moved by ``t`` pixels diagonally both ways (with
their mirrors when ``tta_flip`` is on), as airbench's "level 2" test-time augmentation weighs them. A run scores
these views at its final validation only (``Trainer.evaluate`` says why).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lightray.data.sample_hash import hashed_uniforms
from lightray.train.device import host_to_device

_SHIFT_STREAM = 0x5F1  # keeps the shift draws apart from any other draw of the same (seed, epoch, id)


def draw_shifts(seed: int, epochs: np.ndarray, ids: np.ndarray, r: int) -> np.ndarray:
    """(n, 2) int64 (dy, dx) in [-r, r] for each sample, from its own (seed, epoch, sample id)."""
    if r < 0:
        raise ValueError(f"data.translate: bad value {r!r}; expected a whole number of pixels >= 0")
    ids = np.atleast_1d(np.asarray(ids, np.int64))
    epochs = np.broadcast_to(np.asarray(epochs, np.int64), ids.shape)
    u = hashed_uniforms(seed, _SHIFT_STREAM, epochs, ids, 2)
    return np.minimum(np.floor(u * (2 * r + 1)), 2 * r).astype(np.int64) - r


def shift_images(x: torch.Tensor, shifts: torch.Tensor | np.ndarray, r: int) -> torch.Tensor:
    """``x`` (N, C, H, W) with image i moved by ``shifts[i] = (dy, dx)`` pixels (|dy|, |dx| <= r), the edges
    reflected; one gather for the whole batch. Keeps ``x``'s memory format."""
    if r == 0:
        return x
    # Through pinned memory on CUDA: a pageable copy would block the host on every training step.
    s = host_to_device(torch.as_tensor(shifts, dtype=torch.long), x.device)
    n, c, h, w = x.shape
    if h <= r or w <= r:
        raise ValueError(f"a shift of {r} px needs images larger than {r} px; got {h} x {w}")
    padded = F.pad(x, (r, r, r, r), mode="reflect")
    rows = torch.arange(h, device=x.device).view(1, h) + r - s[:, :1]  # (N, H): source row of each output row
    cols = torch.arange(w, device=x.device).view(1, w) + r - s[:, 1:]  # (N, W)
    out = padded[torch.arange(n, device=x.device).view(n, 1, 1, 1), torch.arange(c, device=x.device).view(1, c, 1, 1),
                 rows.view(n, 1, h, 1), cols.view(n, 1, 1, w)]
    channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    return out.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def shift_batch(x: torch.Tensor, seed: int, epochs: np.ndarray, ids: np.ndarray, r: int) -> torch.Tensor:
    """The training unit: each image of ``x`` shifted by its own draw (:func:`draw_shifts`)."""
    return x if r == 0 else shift_images(x, draw_shifts(seed, epochs, ids, r), r)


def tta_logits(model: nn.Module, x: torch.Tensor, flip: bool, translate: int) -> torch.Tensor:
    """Float logits of ``x`` averaged over the test-time views: the image (and its mirror with ``flip``); with
    ``translate`` > 0, half that and half the mean of the image moved by ``translate`` px down-right and up-left
    (each with its mirror under ``flip``)."""

    def viewed(v: torch.Tensor) -> torch.Tensor:
        out = model(v).float()
        return (out + model(torch.flip(v, dims=[3])).float()) / 2 if flip else out

    logits = viewed(x)
    if translate <= 0:
        return logits
    t = translate
    n = x.shape[0]
    moved = [viewed(shift_images(x, np.full((n, 2), d), t)) for d in (t, -t)]
    return 0.5 * logits + 0.25 * (moved[0] + moved[1])


def describe(translate: int, tta_translate: int, tta_flip: bool) -> tuple[str, str]:
    """The unit lines of ``data.translate`` and of the validation views."""
    train = (f"each training image shifted by up to {translate} px each way, edges reflected, per (epoch, sample)"
             if translate else "off (data.translate=0): no shift")
    views = 1 + int(tta_flip)
    tta = f"validation averages {views} view{'s' if views > 1 else ''}: the image"
    tta += ", its mirror" if tta_flip else ""
    if tta_translate:
        tta += f"; the final validation {3 * views}: also each moved by {tta_translate} px diagonally both ways"
    return train, tta
