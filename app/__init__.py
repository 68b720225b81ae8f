"""lightray: ImageNet-class training at record speed on a Ray cluster of spot GPU machines.

``lightray.train(config, **overrides)`` runs a recipe and returns its ``Result``; ``lightray.load_model(run)``
gives a trained run's model and its preprocessing. Torch and Ray are imported on first use, so
``import lightray`` (every command line start) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from lightray.inference import EvalTransform

__all__ = ["Result", "load_model", "train"]


def load_model(run_or_model_dir: str, weights: str = "best", device: Any = "cpu"
               ) -> tuple[torch.nn.Module, EvalTransform]:
    """(model in eval mode, preprocessing transform) of a run's exported model (see ``lightray.inference``)."""
    from lightray.inference import load_model as load

    return load(run_or_model_dir, weights, device)


def __getattr__(name: str) -> Any:
    if name == "Result":
        from lightray.api import Result

        return Result
    if name == "train":
        # The subpackage lightray.train (the worker's training) is callable: lightray.train(config, **overrides)
        # runs lightray.api.train. Importing it here is cheap (torch is imported by its modules, not by it).
        import importlib

        return importlib.import_module("lightray.train")
    raise AttributeError(f"module 'lightray' has no attribute {name!r}")
