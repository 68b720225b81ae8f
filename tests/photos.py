"""Small ImageFolder trees of real JPEG photos whose class is easy to learn: the dominant colour channel."""

from __future__ import annotations

import pathlib

import numpy as np
from PIL import Image


def photo_tree(root: pathlib.Path, size: int, per_class: int = 24, classes: int = 3, val_per_class: int = 6
               ) -> pathlib.Path:
    """An ImageFolder tree of ``size`` x ``size`` JPEGs whose dominant colour channel is the class."""
    rng = np.random.default_rng(0)
    for split, n in (("train", per_class), ("val", val_per_class)):
        for c in range(classes):
            (root / split / f"c{c}").mkdir(parents=True, exist_ok=True)
            for i in range(n):
                arr = (rng.random((size, size, 3)) * 60).astype(np.uint8)
                arr[..., c] += 150
                Image.fromarray(arr).save(root / split / f"c{c}" / f"{i:04d}.jpg", quality=90)
    return root
