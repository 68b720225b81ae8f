"""The images/s timing loop shared by the start-up measurements (CPU decode in a process, decode on a device):
numpy-free and torch-free, so Ray Data's processes can import it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def images_per_s(once: Callable[[], Any], images: int, seconds: float) -> float:
    """Images/s of ``once()`` (which handles ``images`` images) after one untimed warm-up call (codecs, the
    allocator, nvJPEG's handles); at least one timed call, more until ``seconds`` have passed."""
    once()
    n, t0 = 0, time.perf_counter()
    while True:
        once()
        n += images
        if time.perf_counter() - t0 >= seconds:
            return n / (time.perf_counter() - t0)
