"""Ray Data's share of the cluster's CPUs, sized from the cluster a worker group has when it starts.

Ray Data's tasks and the Train workers draw on the same CPUs, and Data tasks starved by the workers'
reservations deadlock (ray#44687), so Ray Data is capped at what the workers leave. The cap used to be fixed
once before the first worker existed: on a cluster that autoscales from a head alone, that was the 0.5-CPU floor
for the whole run, whatever machines came later. ``PlanDataConfig.configure`` (called by Ray Train at every
worker-group start) sizes it here again from the nodes alive then, and says so as the ``data_share`` unit.
"""

from __future__ import annotations

from typing import Any

import ray

FLOOR_CPUS = 0.5  # Ray Data always gets something: a cap of 0 would stop the input pipeline


def data_cpu_share(world_size: int, cpus_per_worker: float, cluster_cpus: float | None = None) -> dict[str, Any]:
    """{"cluster_cpus", "train_cpus", "data_cpus"}: what ``world_size`` workers of ``cpus_per_worker`` leave
    Ray Data of the cluster's CPUs (``cluster_cpus``, default the alive nodes' total now)."""
    total = float(ray.cluster_resources().get("CPU", 0.0)) if cluster_cpus is None else float(cluster_cpus)
    train = world_size * cpus_per_worker
    return {"cluster_cpus": total, "train_cpus": train, "data_cpus": max(FLOOR_CPUS, total - train)}


def describe(share: dict[str, Any], world_size: int, nodes: int) -> str:
    return (f"Ray Data gets {share['data_cpus']:g} of the cluster's {share['cluster_cpus']:g} CPUs "
            f"({world_size} workers on {nodes} node(s) hold {share['train_cpus']:g}), sized at this worker-group "
            f"start")
