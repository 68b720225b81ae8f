"""The interface every comm mode implements, and what the modes of one worker's hook share.

Laid out as torch's own DDP comm hooks are (``torch.distributed.algorithms.ddp_comm_hooks``: one module per way of
reducing a bucket, each a function of a state object and the bucket): each mode is a module with one
:class:`CommMode` that reduces one :class:`Bucket`; the state they share (the slot store of residuals and
velocities, the loss-scale journal, the byte meter, momentum correction) is one :class:`Shared`; ``CommHook`` picks
the mode for each step and bucket and does the bookkeeping that is the same for all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lightray.comm.loss_scale import LossScaleJournal
from lightray.comm.slots import Layout, SlotStore, new_slots
from lightray.comm.topology import Topology
from lightray.comm.wire import WireMeter
from lightray.config import CommConfig

Reduced = torch.Tensor | torch.futures.Future  # a mode's result: the averaged bucket, or its future


@dataclass
class Velocity:
    """Momentum correction (DGC): whether the hook owns momentum, and the schedule's momentum for this step."""

    on: bool = False
    nesterov: bool = False
    momentum: float = 0.0


@dataclass
class Shared:
    """What every mode of one worker's hook reads and writes."""

    cfg: CommConfig
    topology: Topology
    device: torch.device
    slots: dict[str, SlotStore] = field(default_factory=new_slots)
    journal: LossScaleJournal = field(default_factory=LossScaleJournal)
    meter: WireMeter = field(default_factory=WireMeter)
    velocity: Velocity = field(default_factory=Velocity)

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def sent(self, nbytes: int, crosses_nodes: bool | None = None) -> None:
        """Count ``nbytes`` put on the wire; by default they cross nodes when the run spans several (a flat ring's
        node-crossing links carry as much as the others)."""
        self.meter.add(nbytes, self.topology.num_nodes > 1 if crosses_nodes is None else crosses_nodes)


class Bucket:
    """One bucket as a mode reads it: the calls torch's own hooks make on DDP's ``GradBucket`` (``index``,
    ``buffer``, ``gradients``, ``is_last``) and the (parameter name, numel) layout per-parameter state is keyed by.
    ``gradients`` is a list or a function that makes it (DDP's views are made only for a mode that asks)."""

    __slots__ = ("_index", "_buffer", "layout", "_gradients", "_last")

    def __init__(self, index: int, buffer: torch.Tensor, layout: Layout,
                 gradients: list[torch.Tensor] | Callable[[], list[torch.Tensor]] = (), last: bool = True):
        self._index, self._buffer, self.layout, self._gradients, self._last = index, buffer, layout, gradients, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients() if callable(self._gradients) else list(self._gradients)

    def is_last(self) -> bool:
        return self._last


class CommMode:
    """One way of averaging a bucket across the workers. ``reduce`` returns the averaged bucket (``sync``) or a
    future of it, so DDP's backward goes on while the collective runs."""

    name = ""
    compresses = False  # whether a step in this mode counts as a compressed step
    own_warmup = False  # runs its own dense warm-up (the hook's comm.warmup_steps do not apply)

    def __init__(self, shared: Shared):
        self.shared = shared

    def reduce(self, bucket: Bucket, sync: bool) -> Reduced:
        raise NotImplementedError

    def compressed_now(self) -> bool:
        """Whether this step sends less than dense (PowerSGD runs its own dense warm-up)."""
        return self.compresses

    def passed_over(self) -> None:
        """A step the hook reduced densely in this mode's place (its dense steps after a worker-set change)."""

    def describe(self) -> str:
        return self.name

