"""NumPy's random state as a tensor and plain numbers: a checkpoint that holds it still loads with
``torch.load(weights_only=True)``, which refuses pickled NumPy objects. The trainer's RNG and PowerSGD's use it."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def numpy_rng_to_plain(state: tuple) -> dict[str, Any]:
    """NumPy's ``RandomState.get_state()`` tuple as a tensor and plain numbers (a pickled array would stop
    ``weights_only=True`` loading it)."""
    kind, keys, pos, has_gauss, gauss = state
    return {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}


def numpy_rng_from_plain(d: dict[str, Any]) -> tuple:
    """The ``set_state`` tuple of ``numpy_rng_to_plain``'s dict (its tensor may sit on any device)."""
    keys = d["keys"].detach().cpu().numpy().astype(np.uint32)
    return d["kind"], keys, int(d["pos"]), int(d["has_gauss"]), float(d["cached_gaussian"])
