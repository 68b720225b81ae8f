"""ASHA rungs placed where a comparison between trials is fair: in samples seen, at the schedule's phase
boundaries, after the warm-up.

Trials with different global batches run different numbers of steps per epoch, and a trial still in its
LR warm-up (or in a low-resolution phase its rival has already left) is not comparable to one past it.
So the rungs are counted in samples seen (every validated report carries ``samples_seen``), placed at the
epoch boundaries where the recipe's phases change (resolution, batch), and none comes before the grace
period, which is taken from the recipe: the end of the longest warm-up the space can sample (at least one
epoch). A schedule with a single phase in the budget has no boundary to use: its rungs fall at the grace
period times the reduction factor's powers, in whole epochs. A rung's milestone is the samples seen at
that epoch's start by the trial with the largest batch (the fewest samples: the last partial batch of an
epoch is dropped), so every trial reaches each rung at the same epoch.
"""

from __future__ import annotations

import math
from typing import Any

from lightray.config import Config
from lightray.schedule import Schedule, resolve, warmup_epochs
from lightray.tune.space import GLOBAL_BATCH, SearchSpace, apply_params

TIME_ATTR = "samples_seen"


def grace_epochs(trial_base: Config, sp: SearchSpace) -> int:
    """``scheduler.grace_period`` when the space gives one, else the end of the longest warm-up it can
    sample (``schedule.warmup_epochs`` or ``schedule.warmup`` searched: its upper bound), at least 1."""
    if sp.grace_period:
        return sp.grace_period
    longest = warmup_epochs(trial_base.schedule)
    for p in sp.params:
        if p.key in ("schedule.warmup_epochs", "schedule.warmup") and p.dist != "choice":
            cfg = apply_params(trial_base, {p.key: p.high})
            longest = max(longest, warmup_epochs(cfg.schedule))
        elif p.key in ("schedule.warmup_epochs", "schedule.warmup"):
            longest = max([longest] + [warmup_epochs(apply_params(trial_base, {p.key: v}).schedule)
                                       for v in p.values])
    return max(1, math.ceil(longest - 1e-9))


def rung_epochs(trial_base: Config, sp: SearchSpace) -> list[int]:
    """The epochs (boundaries, whole) at which ASHA compares trials, ascending, each inside the budget."""
    budget = sp.budget_epochs
    grace = grace_epochs(trial_base, sp)
    phases = resolve(trial_base.schedule, trial_base.optim).phases
    bounds = sorted({p.end_epoch for p in phases[:-1] if grace <= p.end_epoch < budget})
    if bounds:
        return bounds
    out, e = [], float(grace)
    while round(e) < budget:
        if round(e) not in out:
            out.append(round(e))
        e *= sp.reduction_factor
    return out


def _candidate_configs(trial_base: Config, sp: SearchSpace) -> list[Config]:
    """The trial configs whose steps per epoch differ: one per global batch the space can sample."""
    for p in sp.params:
        if p.key == GLOBAL_BATCH:
            return [apply_params(trial_base, {GLOBAL_BATCH: v}) for v in p.candidates()]
    return [trial_base]


def rung_milestones(trial_base: Config, sp: SearchSpace, train_size: int) -> dict[str, Any]:
    """``{epochs, samples, max_samples}``: the rungs in epochs and in samples seen, and the most samples a
    trial can see (ASHA's ``max_t``)."""
    epochs = rung_epochs(trial_base, sp)
    scheds = [Schedule(c.schedule, c.optim, train_size) for c in _candidate_configs(trial_base, sp)]
    samples = [min(s.epoch_start(e) for s in scheds) for e in epochs]
    return {"epochs": epochs, "samples": samples, "max_samples": max(s.total_samples for s in scheds)}


def stop_rung(samples_seen: int | None, milestones: list[int]) -> int:
    """How many rungs a trial passed (0: stopped or ended before the first)."""
    if not samples_seen:
        return 0
    return sum(1 for m in milestones if samples_seen >= m)


def make_asha(sp: SearchSpace, rungs: dict[str, Any]):
    """Ray's ASHA with its rungs replaced by ``rungs["samples"]`` (time attribute: samples seen)."""
    from ray.tune.schedulers import ASHAScheduler

    milestones = [m for m in rungs["samples"] if 0 < m < rungs["max_samples"]]
    max_t = max(1, int(rungs["max_samples"]))
    sched = ASHAScheduler(time_attr=TIME_ATTR, metric=sp.tune_metric, mode=sp.tune_mode, max_t=max_t,
                          grace_period=min(max_t, milestones[0] if milestones else max_t),
                          reduction_factor=sp.reduction_factor, brackets=sp.brackets)
    for s, bracket in enumerate(sched._brackets):
        # Bracket s starts s rungs later (as Ray's own brackets do); rungs are kept in descending order.
        bracket._rungs = [(m, {}) for m in reversed(milestones[s:])]
    return sched
