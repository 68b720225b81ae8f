"""One sample's crop draws, for tests that check a batch sample by sample."""

from __future__ import annotations

import numpy as np

from lightray.data import augment


def draw_crop(seed: int, epoch: int, sample_id: int, width: int, height: int,
              min_scale: float) -> tuple[tuple[float, float, float, float], bool]:
    """(crop box, flip) of one sample: :func:`lightray.data.augment.draw_crops` of a block of one."""
    boxes, flips = augment.draw_crops(seed, np.array([epoch]), np.array([sample_id]), np.array([height]),
                                      np.array([width]), min_scale)
    x0, y0, x1, y1 = boxes[0].tolist()
    return (x0, y0, x1, y1), bool(flips[0])
