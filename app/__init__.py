"""lightray: ImageNet-class training at record speed on a Ray cluster of spot GPU machines.

``lightray.train(config, **overrides)`` runs a recipe and returns its ``Result``; ``lightray.load_model(run)``
gives a trained run's model and its preprocessing. They are loaded on first use, with torch and Ray, so
``import lightray`` (every command line start) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Result", "load_model", "train"]

# name -> (module, attribute); None: the module itself. lightray.train is the worker-training package, made
# callable: the call runs lightray.api.train (app/train/__init__.py).
_LAZY = {"Result": ("lightray.api", "Result"), "train": ("lightray.train", None)}


def load_model(*args: Any, **kwargs: Any) -> Any:
    """``(model in eval mode, preprocessing transform)`` of a run's exported model: see
    ``lightray.inference.load_model`` (torch is imported at the call, not when this name is looked up)."""
    from lightray.inference import load_model as load

    return load(*args, **kwargs)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'lightray' has no attribute {name!r}")
    module, attr = _LAZY[name]
    found = importlib.import_module(module)
    return found if attr is None else getattr(found, attr)
