"""What a collective puts on the wire, per worker (the byte meters of every comm mode), and a future that is
already done (what a mode that reduced a bucket synchronously hands back to DDP)."""

from __future__ import annotations

import torch


def ring_allreduce_bytes(nbytes: int, world: int) -> int:
    """Bytes each worker sends in a ring all-reduce of ``nbytes``."""
    return 0 if world <= 1 else int(2 * (world - 1) * nbytes / world)


def allgather_bytes(payload: int, world: int) -> int:
    """Bytes each worker sends in an all-gather where it contributes ``payload`` bytes."""
    return 0 if world <= 1 else (world - 1) * payload


def done(t: torch.Tensor) -> torch.futures.Future:
    """A future that already holds ``t``."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(t)
    return fut


class WireMeter:
    """The bytes one worker's hook put on the wire (``sent``), the part of them that crossed nodes (``inter_node``)
    and what dense fp32 would have sent for the same buckets (``dense``)."""

    def __init__(self) -> None:
        self.sent = 0
        self.inter_node = 0
        self.dense = 0

    def add(self, nbytes: int, crosses_nodes: bool) -> None:
        self.sent += nbytes
        if crosses_nodes:
            self.inter_node += nbytes
