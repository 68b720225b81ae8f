"""Phases (resolution, batch size) and LR/momentum curves as functions of samples seen.

An epoch ``e`` belongs to the first phase whose ``until_epoch > e``; it runs ``N // B_e`` global
steps of ``B_e`` samples (the tail that does not fill a global batch is left out of that epoch, as
``DistributedSampler(drop_last=True)`` does; the epoch plan shuffles a different tail out each
time). ``samples_seen`` therefore maps one-to-one onto (epoch, step), and every curve below is
evaluated from that position: the same for 1 or 64 workers, and across resumes.

Learning rate: linear scaling rule ``lr = lr_per_256 * B / 256`` with ``B`` the *current* phase's
global batch (fast.ai's dynamic batch size rescales the LR with the batch), times a shape that
depends on epoch progress: linear warm-up from ``warmup_start_factor``, then the chosen decay.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from app.config import OptimConfig, Phase, ScheduleConfig


@dataclass(frozen=True)
class Position:
    epoch: int
    step_in_epoch: int  # global steps already done in this epoch
    steps_in_epoch: int
    phase_index: int

    @property
    def epoch_progress(self) -> float:
        return self.epoch + self.step_in_epoch / max(1, self.steps_in_epoch)


class Schedule:
    """Maps samples seen to (epoch, step, phase) and to the LR and momentum to use."""

    def __init__(self, sched: ScheduleConfig, optim: OptimConfig, train_size: int):
        if train_size < 1:
            raise ValueError(f"train_size: bad value {train_size}; expected at least 1 sample")
        self.cfg = sched
        self.optim = optim
        self.train_size = train_size
        self.epochs = int(sched.epochs)
        self._epoch_start: list[int] = [0]  # samples seen at the start of each epoch
        for e in range(self.epochs):
            b = self.phase_for_epoch(e).batch_size
            steps = train_size // b
            if steps < 1:
                raise ValueError(
                    f"schedule.phases: global batch {b} of epoch {e} exceeds the {train_size} training samples"
                )
            self._epoch_start.append(self._epoch_start[-1] + steps * b)

    # --- structure -------------------------------------------------------------------------
    @property
    def total_samples(self) -> int:
        return self._epoch_start[-1]

    def phase_index_for_epoch(self, epoch: int) -> int:
        for i, ph in enumerate(self.cfg.phases):
            if epoch < ph.until_epoch:
                return i
        return len(self.cfg.phases) - 1

    def phase_for_epoch(self, epoch: int) -> Phase:
        return self.cfg.phases[self.phase_index_for_epoch(epoch)]

    def steps_in_epoch(self, epoch: int) -> int:
        return self.train_size // self.phase_for_epoch(epoch).batch_size

    def epoch_start(self, epoch: int) -> int:
        return self._epoch_start[epoch]

    def locate(self, samples_seen: int) -> Position:
        """The position reached after ``samples_seen`` samples (must lie on a step boundary)."""
        samples_seen = min(max(0, int(samples_seen)), self.total_samples)
        e = min(bisect.bisect_right(self._epoch_start, samples_seen) - 1, self.epochs - 1)
        b = self.phase_for_epoch(e).batch_size
        offset = samples_seen - self._epoch_start[e]
        if offset % b:
            raise ValueError(f"samples_seen={samples_seen} is not on a step boundary of epoch {e} (batch {b})")
        return Position(e, offset // b, self.steps_in_epoch(e), self.phase_index_for_epoch(e))

    def phase_at(self, samples_seen: int) -> Phase:
        return self.cfg.phases[self.locate(samples_seen).phase_index]

    # --- curves ----------------------------------------------------------------------------
    def lr_shape(self, progress: float) -> float:
        """Multiplier of the peak LR at ``progress`` epochs."""
        c = self.cfg
        if c.warmup_epochs > 0 and progress < c.warmup_epochs:
            return c.warmup_start_factor + (1 - c.warmup_start_factor) * progress / c.warmup_epochs
        span = max(1e-12, self.epochs - c.warmup_epochs)
        t = min(1.0, max(0.0, (progress - c.warmup_epochs) / span))
        lo = c.final_lr_factor
        if c.decay == "linear":
            return lo + (1 - lo) * (1 - t)
        if c.decay == "cosine":
            return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * t))
        if c.decay == "poly":
            return lo + (1 - lo) * (1 - t) ** c.poly_power
        if c.decay == "step":
            return c.step_gamma ** sum(1 for m in c.step_milestones if progress >= m)
        return 1.0

    def lr_at(self, samples_seen: int) -> float:
        pos = self.locate(samples_seen)
        batch = self.cfg.phases[pos.phase_index].batch_size
        return self.optim.lr_per_256 * batch / 256.0 * self.lr_shape(pos.epoch_progress)

    def momentum_at(self, samples_seen: int) -> float:
        """Base momentum, or (with ``momentum_schedule``) lowered while the LR is high."""
        m = self.optim.momentum
        if not self.cfg.momentum_schedule:
            return m
        shape = self.lr_shape(self.locate(samples_seen).epoch_progress)
        # One-cycle style: momentum dips from m towards m - 0.1 (never below 0) as the LR shape goes 0 -> 1.
        return max(0.0, m - 0.1 * shape)
