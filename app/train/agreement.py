"""One decision for all ranks: each rank's local flags (its clock says a timed checkpoint is due, it has a
spot notice), OR-ed across the worker group in one small all-reduce.

A choice that changes the sequence of collectives or of ``ray.train.report`` calls must be the same on every
rank at the same step. Ranks on many machines cross a wall-clock threshold at different steps, and a drain
notice can reach one node before another: acting on a local view would send one rank into a checkpoint report
while the others train on (a hang until the collective timeout, or a checkpoint of mixed steps). The exchange
runs only at steps every rank takes it at (report steps), where the step already waits for the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def agree(flags: list[bool], device: torch.device) -> list[bool]:
    """``flags`` OR-ed over every rank of the default process group (as they are without one)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [bool(f) for f in flags]
    # NCCL reduces only device tensors; gloo only host ones.
    where = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32, device=where)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]
