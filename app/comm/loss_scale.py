"""The loss-scale journal every comm mode shares: fp16 loss scaling's view of the hook's slot state.

Residuals and velocities are kept unscaled (divided by the loss scale S when written, multiplied when sent; exact, S
being a power of two), so a change of the scale changes nothing they deliver. The scaler skips a step when the
*averaged* gradient holds inf or nan; the slot tensors that step changed are then put back on every rank. Which
step was skipped is known only after ``scaler.update()``: it lowered the scale (its backoff factor is < 1, and it
backs off exactly when it skipped). So each slot tensor a step changes is copied first (``add``), and at the next
step's first bucket ``torch.where(scale now < scale then, copy, value)`` puts back the copies of a skipped step, on
the device (``begin_step``). See ``CommHook.follow_loss_scale``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class LossScaleJournal:
    """This step's loss scale S and 1/S (device tensors, None without fp16 loss scaling) and the slot tensors this
    step changed, each with its value before."""

    def __init__(self) -> None:
        self.scaler: Any = None
        self.scale: torch.Tensor | None = None
        self.unscale: torch.Tensor | None = None
        self.entries: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._scale_then: torch.Tensor | None = None

    def follow(self, scaler: torch.amp.GradScaler | None) -> None:
        """Follow ``scaler`` (a disabled one, as under bf16 or fp32, is ignored)."""
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None

    def _scaler_scale(self) -> torch.Tensor | None:
        # The scaler's own tensor, not get_scale(): that returns a float, a host read at every step.
        return None if self.scaler is None else getattr(self.scaler, "_scale", None)

    def begin_step(self) -> None:
        """At a step's first bucket: settle the last step's journal, take this step's loss scale."""
        now = self._scaler_scale()
        self._settle(now)
        if now is None:
            self.scale = self.unscale = None
            return
        self.scale = now.clone()  # the scaler's tensor changes in place at update()
        self.unscale = self.scale.reciprocal()
        self._scale_then = self.scale

    def add(self, t: torch.Tensor) -> None:
        """Keep ``t``'s value before this step changes it in place (only under loss scaling: only then can a step
        be skipped)."""
        if self.scale is not None:
            self.entries.append((t, t.clone()))

    def clear(self) -> None:
        """Forget the journal (its tensors belonged to a state that was replaced)."""
        self.entries = []

    def _skipped(self, now: torch.Tensor | None) -> torch.Tensor | None:
        """Whether the scaler skipped the journal's step (a 0-d bool on the device), None when it cannot say."""
        if not self.entries or now is None or self._scale_then is None:
            return None
        return now < self._scale_then

    def _settle(self, now: torch.Tensor | None) -> None:
        skipped = self._skipped(now)
        if skipped is not None:
            for live, before in reversed(self.entries):  # reversed: a tensor changed twice gets its first copy
                torch.where(skipped, before, live, out=live)
        self.entries = []

    @contextlib.contextmanager
    def as_decided(self) -> Iterator[None]:
        """The slot state as the scaler's decision on the last step leaves it, without settling it: read before
        ``scaler.update()``, the step still counts; the next step's first bucket settles it for good."""
        skipped = self._skipped(self._scaler_scale())
        if skipped is None:
            yield
            return
        kept = [live.clone() for live, _ in self.entries]
        for live, before in reversed(self.entries):
            torch.where(skipped, before, live, out=live)
        try:
            yield
        finally:
            for (live, _), value in zip(self.entries, kept):
                live.copy_(value)
