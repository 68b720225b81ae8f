"""Lookahead (``optim.lookahead_every``; 0 = off), as airbench94 schedules it (Zhang et al. 2019).

A slow copy of the weights (and of the floating BN buffers) follows the live ones: every ``k`` steps
``slow = d * slow + (1 - d) * live`` and the live weights jump back to ``slow``. ``d`` grows with the samples
seen, ``d = 0.95^k * progress^3``: early on the slow copy is the live model (no averaging while the weights move
far), near the end it averages the last few hundred steps, which is what an EMA gives at the end of a short run
without lagging behind early. At the end of training the live weights take the slow ones. Every rank does the
same arithmetic on the same weights, so ranks stay equal with no communication.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightray.train.device import unwrap_model

BASE = 0.95  # airbench94's per-step decay base


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    live = unwrap_model(model)
    return [t for t in list(live.parameters()) + list(live.buffers()) if t.is_floating_point()]


class Lookahead:
    """The slow weights of ``model`` and the rule that moves them."""

    def __init__(self, model: nn.Module, every: int):
        if every < 1:
            raise ValueError(f"optim.lookahead_every: bad value {every!r}; expected a whole number of steps >= 1")
        self.every = int(every)
        self.slow = [t.detach().clone() for t in _tensors(model)]

    def decay_at(self, progress: float) -> float:
        """``d`` at ``progress`` (samples seen over the run's total, in [0, 1])."""
        return BASE ** self.every * min(max(progress, 0.0), 1.0) ** 3

    @torch.no_grad()
    def after_step(self, model: nn.Module, step: int, progress: float) -> bool:
        """Called after optimiser step ``step`` (1-based); on every ``every``-th, pull the slow weights towards the
        live ones and put them back into the model. Returns whether it synced."""
        if step % self.every:
            return False
        live = _tensors(model)
        torch._foreach_lerp_(self.slow, [t.to(s.dtype) for s, t in zip(self.slow, live)], 1.0 - self.decay_at(progress))
        torch._foreach_copy_(live, self.slow)
        return True

    @torch.no_grad()
    def finish(self, model: nn.Module) -> None:
        """End of training: the model takes the slow weights."""
        torch._foreach_copy_(_tensors(model), self.slow)

    @torch.no_grad()
    def reset(self, model: nn.Module) -> None:
        """Take the model's current weights as the slow ones (after a unit changed them before the first step)."""
        torch._foreach_copy_(self.slow, _tensors(model))

    def state_dict(self) -> dict[str, Any]:
        return {"every": self.every, "slow": [t.clone() for t in self.slow]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        slow = state.get("slow")
        if not isinstance(slow, list) or len(slow) != len(self.slow):
            raise ValueError(f"Lookahead.load_state_dict: the checkpoint holds {len(slow or [])} slow tensors, "
                             f"the model {len(self.slow)}; expected a checkpoint of this model")
        with torch.no_grad():
            torch._foreach_copy_(self.slow, slow)


def describe(every: int) -> str:
    """The unit line."""
    if not every:
        return "off (optim.lookahead_every=0)"
    return (f"every {every} steps the weights move to the slow average (decay {BASE}^{every} x progress^3) and "
            "the model takes them at the end")
