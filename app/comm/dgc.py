"""Deep Gradient Compression's accuracy techniques (Lin et al. 2018, section 3.2), as pure functions.

The communication hook (``lightray.comm.hook``) applies them per bucket; each is switched by a
``comm.*`` key and reported by the hook:

- momentum correction (``comm.momentum_correction``): each worker accumulates its local velocity
  ``u = m u + g`` (Nesterov: ``u = m (u + g)``, sending ``u + g``) and adds *that* to the residual, so a
  coordinate sent late carries the momentum it would have had. The hook then returns the averaged
  velocity, and the optimizer must not apply momentum again: see ``CommHook.optimizer_momentum``.
- local gradient clipping (``comm.local_clip``): each worker clips its local bucket gradient to
  ``local_clip / sqrt(world)`` before accumulating it (the sum of ``world`` independent gradients has a
  norm about ``sqrt(world)`` times each one's).
- momentum-factor masking (``comm.momentum_masking``): the velocity is zeroed where an entry was sent,
  so stale momentum does not keep pushing a coordinate whose accumulated update was just applied.
- sparsity warm-up (``comm.sparsity_warmup_epochs``): the ratio ramps exponentially from
  ``comm.sparsity_warmup_start`` down to ``comm.ratio`` over the first epochs (DGC: 25%, 6.25%, 1.56%,
  0.4%, 0.1% over four epochs), as a function of samples seen so resizes and resumes keep the curve.
"""

from __future__ import annotations

import math

import torch


def warmup_ratio(target: float, start: float, warmup_epochs: float, epochs_done: float) -> float:
    """The ratio after ``epochs_done`` epochs: ``start * (target/start) ** (epochs_done/warmup_epochs)``.

    ``target`` once the warm-up is over (or when it is off, or when ``start <= target``).
    """
    if warmup_epochs <= 0 or epochs_done >= warmup_epochs or start <= target:
        return target
    frac = max(0.0, epochs_done) / warmup_epochs
    return start * (target / start) ** frac


def clip_factor(g: torch.Tensor, max_norm: float, world: int,
                unscale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(factor, clipped): what ``g`` is multiplied by to bring its L2 norm to ``max_norm / sqrt(world)`` when
    larger (1 otherwise), and whether it was clipped, both 0-d device tensors, so the step never reads the norm
    on the host. With ``unscale`` (1 / the loss scale) the norm compared is the unscaled gradient's, and the
    factor does not include ``unscale``.

    In float64, as the division of Python floats it replaces was, so the clipped gradient is the same to the bit.
    """
    limit = max_norm / math.sqrt(max(1, world))
    norm = torch.linalg.vector_norm(g).double()
    if unscale is not None:
        norm = norm * unscale
    clipped = norm > limit  # false for a zero norm and for nan, which must not be scaled
    return torch.where(clipped, limit / norm, 1.0), clipped


def clip_local(g: torch.Tensor, max_norm: float, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``g`` scaled to L2 norm ``max_norm / sqrt(world)`` when larger; (tensor, whether it was clipped: 0-d bool)."""
    factor, clipped = clip_factor(g, max_norm, world)
    return g * factor, clipped


def accumulate_velocity(u: torch.Tensor, g: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """Update the velocity ``u`` in place and return what this step contributes to the residual.

    Plain: ``u = m u + g``, contribute ``u``. Nesterov: ``u' = m (u + g)``, contribute ``u' + g``: with
    ``u' = m b`` for torch's SGD buffer ``b = m b + g`` this is torch's Nesterov update ``g + m b``.
    """
    if nesterov:
        u.add_(g).mul_(momentum)
        return u + g
    u.mul_(momentum).add_(g)
    return u
