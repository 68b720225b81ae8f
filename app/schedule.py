"""Phases (resolution, batch size) and LR/momentum curves as functions of samples seen.

A recipe writes its phase ends and warm-up as fractions of the budget (``until``, ``warmup``) or in
absolute epochs (``until_epoch``, ``warmup_epochs``); ``resolve`` turns either into whole-epoch phase
ranges for the run's ``schedule.epochs``, and every reader (ingest specs, the trainer, the LR curve) uses
those ranges. An epoch ``e`` belongs to the first phase whose resolved end is ``> e``; it runs ``N // B_e`` global
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
from dataclasses import asdict, dataclass

from lightray.config import OptimConfig, Phase, ScheduleConfig


@dataclass(frozen=True)
class ResolvedPhase:
    first_epoch: int
    end_epoch: int  # exclusive; equal to first_epoch for a phase the budget leaves out
    resolution: int
    batch_size: int
    min_scale: float
    lr_peak: float  # lr_per_256 * batch / 256: the LR at the top of the curve while this phase runs


@dataclass(frozen=True)
class ResolvedSchedule:
    epochs: int
    warmup_epochs: float
    phases: tuple[ResolvedPhase, ...]

    def to_dict(self) -> dict:
        return {"epochs": self.epochs, "warmup_epochs": self.warmup_epochs,
                "phases": [asdict(p) for p in self.phases]}

    def describe(self) -> str:
        """The lines printed at the start of a run."""
        lines = [f"schedule: {self.epochs} epochs, warm-up {self.warmup_epochs:g} epochs"]
        for i, p in enumerate(self.phases):
            span = f"epochs {p.first_epoch}-{p.end_epoch - 1}" if p.end_epoch > p.first_epoch else "no epochs"
            lines.append(f"  phase {i}: {span}, {p.resolution}px, batch {p.batch_size}, "
                         f"min crop scale {p.min_scale:g}, LR peak {p.lr_peak:.4g}")
        return "\n".join(lines)


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def phase_ends(sched: ScheduleConfig) -> list[int]:
    """Each phase's end epoch (exclusive) for ``sched.epochs``.

    Fractions round half up to whole epochs; each phase then gets at least one epoch when the budget has
    one per phase. With fewer epochs than phases the earliest phases are left out (zero epochs): the last
    phases train at the resolution the model is tested at, which matters most for the final score."""
    epochs, n = int(sched.epochs), len(sched.phases)
    if sched.phases[0].until <= 0:  # absolute epochs, cut at the budget
        return [min(int(ph.until_epoch), epochs) for ph in sched.phases]
    ends = [_round_half_up(ph.until * epochs) for ph in sched.phases]
    ends[-1] = epochs
    if epochs >= n:
        for i in range(n):  # at least one epoch each, leaving one for every later phase
            ends[i] = min(max(ends[i], (ends[i - 1] if i else 0) + 1), epochs - (n - 1 - i))
    else:
        ends = [max(0, epochs - (n - 1 - i)) for i in range(n)]
    return ends


def warmup_epochs(sched: ScheduleConfig) -> float:
    """Warm-up length in epochs: ``warmup`` times the budget (to 0.01 epoch, so that a recipe's rounded
    fraction gives the whole number of epochs it stands for), else ``warmup_epochs``."""
    return round(sched.warmup * sched.epochs, 2) if sched.warmup > 0 else float(sched.warmup_epochs)


def resolve(sched: ScheduleConfig, optim: OptimConfig) -> ResolvedSchedule:
    """The schedule in whole epochs for this budget (what the run prints and saves as schedule.json)."""
    ends, first, phases = phase_ends(sched), 0, []
    for ph, end in zip(sched.phases, ends):
        phases.append(ResolvedPhase(first, end, ph.resolution, ph.batch_size, ph.min_scale,
                                    optim.lr_per_256 * ph.batch_size / 256.0))
        first = end
    return ResolvedSchedule(int(sched.epochs), warmup_epochs(sched), tuple(phases))


@dataclass(frozen=True)
class Position:
    epoch: int
    step_in_epoch: int  # global steps already done in this epoch
    steps_in_epoch: int
    phase_index: int

    @property
    def epoch_progress(self) -> float:
        return self.epoch + self.step_in_epoch / max(1, self.steps_in_epoch)


def validates_after(epoch: int, epochs: int, every: int) -> bool:
    """Whether the 0-based ``epoch`` of ``epochs`` ends with a validation: every ``every``-th and the last."""
    return epoch + 1 >= epochs or (every > 0 and (epoch + 1) % every == 0)


class Schedule:
    """Maps samples seen to (epoch, step, phase) and to the LR and momentum to use."""

    def __init__(self, sched: ScheduleConfig, optim: OptimConfig, train_size: int):
        if train_size < 1:
            raise ValueError(f"train_size: bad value {train_size}; expected at least 1 sample")
        self.cfg = sched
        self.optim = optim
        self.train_size = train_size
        self.epochs = int(sched.epochs)
        self.resolved = resolve(sched, optim)
        self.warmup_epochs = self.resolved.warmup_epochs
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
        for i, ph in enumerate(self.resolved.phases):
            if epoch < ph.end_epoch:
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

    def validates_after(self, epoch: int) -> bool:
        """Whether the epoch ``epoch`` (0-based) ends with a validation: every ``schedule.eval_every_epochs``-th
        epoch and the last one (0 = the last only)."""
        return validates_after(epoch, self.epochs, int(self.cfg.eval_every_epochs))

    def describe_validation(self) -> str:
        """The ``eval_schedule`` unit's line: after which epochs the run validates."""
        after = [e + 1 for e in range(self.epochs) if self.validates_after(e)]
        if len(after) == self.epochs:
            return f"validation after each of the {self.epochs} epochs"
        return (f"validation after epoch{'s' if len(after) > 1 else ''} {', '.join(map(str, after))} of "
                f"{self.epochs} (schedule.eval_every_epochs={self.cfg.eval_every_epochs}); the others report "
                "their training figures only")

    def phase_at(self, samples_seen: int) -> Phase:
        return self.cfg.phases[self.locate(samples_seen).phase_index]

    # --- curves ----------------------------------------------------------------------------
    def lr_shape(self, progress: float) -> float:
        """Multiplier of the peak LR at ``progress`` epochs."""
        c, warm = self.cfg, self.warmup_epochs
        if warm > 0 and progress < warm:
            return c.warmup_start_factor + (1 - c.warmup_start_factor) * progress / warm
        span = max(1e-12, self.epochs - warm)
        t = min(1.0, max(0.0, (progress - warm) / span))
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
