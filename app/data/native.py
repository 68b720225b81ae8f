"""Recipes that fit the data: the source's native size (median short side of its training images) caps every
phase, tier and the test resolution, unless the recipe asks to upscale (``schedule.allow_upscale``).

A phase above the native size trains on upsampled photos: no detail to learn from, at the cost of a larger
image (the demo recipe's 64 px on 32 px CIFAR-10 photos is four times the pixels of 32 px). A recipe can
also state a phase's resolution relative to the native size (``scale: 0.75`` on 32 px photos is 24 px), so
one recipe serves sources of different sizes.

Prepare probes the size from a seeded sample of image headers before it chooses the tiers to build
(:func:`probe`), and records the exact median of everything it read in the manifest
(``native_short_side``); the run fits its schedule to that (:func:`fit_schedule`).
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Iterable
from typing import Any

from PIL import Image

from lightray.config import EVAL_RES_FACTOR, Config

PROBE_SAMPLES = 64
MIN_RESOLUTION = 8


def short_side(data: bytes) -> int | None:
    """The short side of an encoded image from its header (no decode); None when it is not an image."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            return min(img.size)
    except Exception:  # noqa: BLE001 - any unreadable header: the sample is left out of the probe
        return None


def median_of_histogram(hist: dict[int, int]) -> int | None:
    """The lower median of a {short side: count} histogram."""
    total = sum(hist.values())
    if not total:
        return None
    seen = 0
    for size in sorted(hist):
        seen += hist[size]
        if 2 * seen >= total:
            return int(size)
    return None


def median(sizes: Iterable[int]) -> int | None:
    return median_of_histogram(Counter(int(s) for s in sizes))


def resolved_resolution(phase: Any, native: int | None) -> int:
    """A phase's resolution in pixels: ``scale`` times the native size (a multiple of 4, at least 8 px)."""
    if phase.scale > 0:
        if native is None:
            raise ValueError("a phase gives scale (relative to the native size) but the source's size is unknown")
        return max(MIN_RESOLUTION, int(round(phase.scale * native / 4)) * 4)
    return int(phase.resolution)


def fit_schedule(cfg: Config, native: int | None) -> list[str]:
    """Resolve relative phase resolutions and cap every resolution at ``native`` (in place, idempotent);
    returns one line per change, saying what and why. Nothing is capped with ``schedule.allow_upscale``."""
    sched, notes = cfg.schedule, []
    for i, ph in enumerate(sched.phases):
        if ph.scale > 0:
            ph.resolution = resolved_resolution(ph, native)
            notes.append(f"phase {i}: scale {ph.scale:g} x native {native} px = {ph.resolution} px")
            ph.scale = 0.0
    if native is None or sched.allow_upscale:
        if native is not None and any(ph.resolution > native for ph in sched.phases):
            notes.append(f"phases above the native {native} px train on upscaled images (schedule.allow_upscale)")
        return notes
    for i, ph in enumerate(sched.phases):
        if ph.resolution > native:
            notes.append(f"phase {i}: {ph.resolution} px clipped to the source's native {native} px (median short "
                         f"side): above it a phase trains on upscaled images; schedule.allow_upscale=true keeps it")
            ph.resolution = native
    final = sched.phases[-1].resolution
    fixres = max(MIN_RESOLUTION, round(final * EVAL_RES_FACTOR / 8) * 8)
    if (sched.eval_resolution or fixres) > native:
        was = sched.eval_resolution or fixres
        notes.append(f"eval resolution {was} px clipped to the native {native} px: a test image above it is "
                     "an upscaled photo")
        sched.eval_resolution = native
    return notes
