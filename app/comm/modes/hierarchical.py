"""The ``hierarchical_topk`` mode: the bucket is first summed densely among the workers of one node (fast links);
the node sum is cut into ``M`` chunks (M = workers per node) and the worker with local rank ``j`` sparsifies chunk
``j`` (plus its residual) and exchanges it only with the workers of local rank ``j`` on the other nodes; the
averaged chunks are then all-gathered inside the node. So only ``k`` entries per chunk cross the slow network, and
all ``M`` NICs/streams share the work. Nodes of unequal worker counts fall back to flat top-k, one node to dense
(``make_groups`` says which)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightray.comm.modes.base import Bucket, CommMode, Reduced, Shared
from lightray.comm.modes.sparse import Sparsifier, gather
from lightray.comm.topology import Topology, build_groups
from lightray.comm.wire import allgather_bytes, ring_allreduce_bytes


@dataclass
class NodeGroups:
    """This rank's process groups: its node's, and the one across nodes of the workers of its local index."""

    node: Any = None
    cross: Any = None
    node_size: int = 1
    num_nodes: int = 1
    chunk_of_member: list[int] = field(default_factory=list)  # the chunk each member of the node group holds
    local_index: int = 0

    def named(self) -> dict[int, str]:
        """id(process group) -> its name, for meters that count bytes per group."""
        return {id(self.node): "node", id(self.cross): "cross_node"}


@dataclass
class NoGroups:
    """Why hierarchical top-k has no groups here: ``uneven`` node sizes, or ``one node``."""

    why: str
    sizes: list[int]


def make_groups(topology: Topology, timeout: timedelta | None) -> NodeGroups | NoGroups:
    """Make the node and cross-node groups (a collective: every rank creates every group, in the same order, as
    ``new_group`` requires)."""
    node_groups, cross_groups = build_groups(topology)
    sizes = {len(g) for g in node_groups}
    made_nodes = [dist.new_group(g, timeout=timeout) for g in node_groups]
    made_cross = [dist.new_group(g, timeout=timeout) for g in cross_groups]
    rank = dist.get_rank()
    placement_local = {r: i for i, g in enumerate(cross_groups) for r in g}
    if len(sizes) != 1 or any(sorted(placement_local[r] for r in g) != list(range(len(g))) for g in node_groups):
        return NoGroups("uneven", sorted(len(g) for g in node_groups))
    if len(node_groups) == 1:
        return NoGroups("one node", [len(node_groups[0])])
    out = NodeGroups(node_size=sizes.pop(), num_nodes=len(node_groups), local_index=placement_local[rank])
    for g, pg in zip(node_groups, made_nodes):
        if rank in g:
            out.node = pg
            out.chunk_of_member = [placement_local[r] for r in g]  # g is sorted like the group
    for g, pg in zip(cross_groups, made_cross):
        if rank in g:
            out.cross = pg
    return out


class HierarchicalTopK(CommMode):
    name = "hierarchical_topk"
    compresses = True

    def __init__(self, shared: Shared, sparsifier: Sparsifier, groups: NodeGroups):
        super().__init__(shared)
        self.sparse, self.groups = sparsifier, groups

    def reduce(self, bucket: Bucket, sync: bool) -> Reduced:
        buf, index, layout = bucket.buffer(), bucket.index(), bucket.layout
        g, s = self.groups, self.shared
        world, m, nodes, n = s.world_size, g.node_size, g.num_nodes, buf.numel()
        node_sum = buf.float().clone()
        # The node sum and the cross-node exchange are synchronous (each feeds the next step of this bucket); the
        # closing all-gather inside the node runs asynchronously unless ``sync``.
        dist.all_reduce(node_sum, group=g.node)
        s.sent(ring_allreduce_bytes(n * 4, m), crosses_nodes=False)
        c = math.ceil(n / m)
        lo, hi = min(n, g.local_index * c), min(n, (g.local_index + 1) * c)
        padded = torch.zeros(c, dtype=torch.float32, device=buf.device)
        if hi > lo:  # all members of a cross group share local index, hence the same chunk length
            # Each node's velocity is built from its node sum; M times the global velocity per node makes the
            # nodes' contributions, divided by the world size, average to it.
            acc, residual, u = self.sparse.accumulate(node_sum[lo:hi], index, layout, n, lo, hi, float(m))
            packed, k = self.sparse.sparsify(acc, residual, u)
            parts = [torch.empty_like(packed) for _ in range(nodes)]
            dist.all_gather(parts, packed, group=g.cross)
            s.sent(allgather_bytes(packed.numel() * packed.element_size(), nodes), crosses_nodes=True)
            padded[: hi - lo] = self.sparse.scatter_sum(parts, k, hi - lo, buf.device).div_(world)
        s.sent(allgather_bytes(c * 4, m), crosses_nodes=False)

        def finish(chunks: list[torch.Tensor]) -> torch.Tensor:
            ordered = [chunks[g.chunk_of_member.index(j)] for j in range(m)]
            return torch.cat(ordered)[:n].to(buf.dtype)

        return gather(padded, m, g.node, sync, finish)
