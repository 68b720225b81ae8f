"""Exponential moving average of the model's weights (``optim.ema_decay``; 0 = off).

After each optimiser step: ``ema = decay * ema + (1 - decay) * weights`` for every floating-point
parameter. Buffers (BN running mean/var, batch counters) are *copied*, not averaged: they are
statistics of activations that the live model keeps current, and copying keeps the EMA model usable for
evaluation at any time without a BN re-calibration pass.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightray.config import OptimConfig
from lightray.train.device import unwrap_model
from lightray.units import unit_log


class ModelEMA:
    """An averaged copy of ``model`` (DDP / torch.compile wrappers are looked through)."""

    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"optim.ema_decay: bad value {decay!r}; expected a number in [0, 1)")
        self.decay = float(decay)
        self.num_updates = 0
        self.module = copy.deepcopy(unwrap_model(model)).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Fold the live weights into the average and copy the live buffers."""
        live = unwrap_model(model)
        ema_p = [p for p in self.module.parameters()]
        live_p = [p.detach() for p in live.parameters()]
        if len(ema_p) != len(live_p):
            raise ValueError(f"ModelEMA.update: model has {len(live_p)} parameters, the EMA copy {len(ema_p)}")
        floats = [(e, v) for e, v in zip(ema_p, live_p) if e.is_floating_point()]
        if floats:
            # lerp(ema, w, 1 - d) = ema + (1 - d) (w - ema) = d * ema + (1 - d) * w, in one multi-tensor kernel.
            torch._foreach_lerp_([e for e, _ in floats], [v.to(e.dtype) for e, v in floats], 1.0 - self.decay)
        for e, v in zip(self.module.buffers(), live.buffers()):
            e.copy_(v)
        self.num_updates += 1

    @torch.no_grad()
    def reset(self, model: nn.Module) -> None:
        """Start the average again from ``model``'s current weights and buffers."""
        live = unwrap_model(model)
        for e, v in zip(list(self.module.parameters()) + list(self.module.buffers()),
                        list(live.parameters()) + list(live.buffers())):
            e.copy_(v)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "num_updates": self.num_updates, "module": self.module.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"decay", "num_updates", "module"} - set(state)
        if missing:
            raise ValueError(f"ModelEMA.load_state_dict: state lacks {sorted(missing)}")
        self.decay = float(state["decay"])
        self.num_updates = int(state["num_updates"])
        self.module.load_state_dict(state["module"])

    @contextlib.contextmanager
    def applied_to(self, model: nn.Module) -> Iterator[nn.Module]:
        """Temporarily put the EMA weights and buffers into ``model`` (e.g. to evaluate through the same
        DDP / compiled wrapper); the live values come back on exit, also after an exception."""
        live = unwrap_model(model)
        tensors_live = list(live.parameters()) + list(live.buffers())
        tensors_ema = list(self.module.parameters()) + list(self.module.buffers())
        with torch.no_grad():
            saved = [t.detach().clone() for t in tensors_live]
            for t, e in zip(tensors_live, tensors_ema):
                t.copy_(e)
        try:
            yield model
        finally:
            with torch.no_grad():
                for t, s in zip(tensors_live, saved):
                    t.copy_(s)


def maybe_ema(model: nn.Module, cfg: OptimConfig) -> ModelEMA | None:
    """A ModelEMA when ``cfg.ema_decay > 0``, else None; logs which."""
    if cfg.ema_decay <= 0:
        unit_log("ema", "weight EMA off (optim.ema_decay=0)", enabled=False)
        return None
    unit_log("ema", f"weight EMA on, decay {cfg.ema_decay} per step; BN buffers copied", enabled=True,
             decay=cfg.ema_decay)
    return ModelEMA(model, cfg.ema_decay)
