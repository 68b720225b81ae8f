"""lightray: ImageNet-class training at record speed on a Ray cluster of spot GPU machines.

``from app import load_model`` gives a trained run's model and its preprocessing; torch is imported on
first use, so ``import app`` (every command line start) stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_model"]


def __getattr__(name: str) -> Any:
    if name == "load_model":
        from app.inference import load_model

        return load_model
    raise AttributeError(f"module 'app' has no attribute {name!r}")
