"""Where each training worker sits: its node, its place inside the node, the groups it talks in.

Hierarchical communication needs two kinds of process groups: the workers of one node (fast links:
NVLink / PCIe / shared memory) and, across nodes, the workers that share a local rank (one slow
network hop per node pair). Ray Train knows the placement (``ray.train.get_context()``); tests and
single-machine runs simulate N nodes x M workers by declaring ``M`` workers per "node"
(``Topology.simulated`` or the ``LIGHTRAY_SIM_WORKERS_PER_NODE`` environment variable), which then
runs exactly the same group code over gloo on one machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

SIM_ENV = "LIGHTRAY_SIM_WORKERS_PER_NODE"


@dataclass
class Topology:
    world_size: int
    rank: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int

    def __post_init__(self) -> None:
        checks = [
            ("world_size", self.world_size >= 1, "expected >= 1"),
            ("rank", 0 <= self.rank < self.world_size, f"expected 0 <= rank < world_size={self.world_size}"),
            ("local_world_size", 1 <= self.local_world_size <= self.world_size,
             f"expected 1..world_size={self.world_size}"),
            ("local_rank", 0 <= self.local_rank < self.local_world_size,
             f"expected 0 <= local_rank < local_world_size={self.local_world_size}"),
            ("num_nodes", 1 <= self.num_nodes <= self.world_size, f"expected 1..world_size={self.world_size}"),
            ("node_rank", 0 <= self.node_rank < self.num_nodes,
             f"expected 0 <= node_rank < num_nodes={self.num_nodes}"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"Topology.{name}: bad value {getattr(self, name)!r}; {why} ({self})")

    @classmethod
    def simulated(cls, world_size: int, rank: int, workers_per_node: int) -> Topology:
        """Ranks laid out node by node: ranks [0, M) are node 0, [M, 2M) node 1, ..."""
        if workers_per_node < 1 or world_size % workers_per_node != 0:
            raise ValueError(
                f"workers_per_node: bad value {workers_per_node!r}; expected a divisor of world_size={world_size}"
            )
        return cls(world_size=world_size, rank=rank, local_rank=rank % workers_per_node,
                   local_world_size=workers_per_node, node_rank=rank // workers_per_node,
                   num_nodes=world_size // workers_per_node)

    @property
    def uniform(self) -> bool:
        """Every node runs local_world_size workers (needed for same-local-rank cross-node groups)."""
        return self.num_nodes * self.local_world_size == self.world_size

    def describe(self) -> str:
        return (f"{self.num_nodes} node(s) x {self.local_world_size} worker(s); rank {self.rank} = "
                f"node {self.node_rank} local {self.local_rank}")


def _all_ranks_placement(topo: Topology) -> list[tuple[int, int]]:
    """(node_rank, local_rank) of every rank; a collective when a process group is up."""
    if not (dist.is_available() and dist.is_initialized()) or topo.world_size == 1:
        return [(topo.node_rank, topo.local_rank)]
    mine = torch.tensor([topo.node_rank, topo.local_rank], dtype=torch.int64)
    backend = dist.get_backend()
    if backend == "nccl":
        mine = mine.cuda()
    out = [torch.zeros_like(mine) for _ in range(topo.world_size)]
    dist.all_gather(out, mine)
    return [(int(t[0]), int(t[1])) for t in out]


def build_groups(topo: Topology) -> tuple[list[list[int]], list[list[int]]]:
    """(node groups, cross-node groups), each a list of rank lists, identical on every rank.

    A collective (all ranks must call it): the placement of every rank is gathered, because Ray
    Train does not promise that world ranks are numbered node by node.
    """
    placement = _all_ranks_placement(topo)
    if len(placement) == 1 and topo.world_size > 1:
        # No process group: only a simulated layout can be derived locally.
        placement = [(r // topo.local_world_size, r % topo.local_world_size) for r in range(topo.world_size)]
    nodes: dict[int, list[int]] = {}
    locals_: dict[int, list[int]] = {}
    for r, (node, local) in enumerate(placement):
        nodes.setdefault(node, []).append(r)
        locals_.setdefault(local, []).append(r)
    node_groups = [sorted(nodes[k]) for k in sorted(nodes)]
    cross_groups = [sorted(locals_[k], key=lambda r: placement[r][0]) for k in sorted(locals_)]
    return node_groups, cross_groups


def topology_from_ray(workers_per_node: int = 0) -> Topology:
    """The calling Ray Train worker's topology.

    ``workers_per_node`` (or ``LIGHTRAY_SIM_WORKERS_PER_NODE``) > 0 pretends the workers are spread
    over ``world_size / workers_per_node`` nodes, so hierarchical communication can run on one machine.
    The number of real nodes is the largest node rank + 1, agreed on by a MAX all-reduce when a
    process group is up (Ray numbers nodes 0..N-1, but a node may hold fewer workers than another).
    """
    import ray.train

    sim = workers_per_node or int(os.environ.get(SIM_ENV, "0") or 0)
    ctx = ray.train.get_context()
    world, rank = ctx.get_world_size(), ctx.get_world_rank()
    if sim > 0:
        return Topology.simulated(world, rank, sim)
    node_rank = ctx.get_node_rank()
    num_nodes = node_rank + 1
    if dist.is_available() and dist.is_initialized() and world > 1:
        t = torch.tensor([num_nodes], dtype=torch.int64)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        num_nodes = int(t.item())
    return Topology(world_size=world, rank=rank, local_rank=ctx.get_local_rank(),
                    local_world_size=ctx.get_local_world_size(), node_rank=node_rank, num_nodes=num_nodes)
