"""Ray Data's share of the cluster's CPUs, sized from the cluster a worker group has when it starts.

Ray Data's tasks and the Train workers draw on the same CPUs, and Data tasks starved by the workers'
reservations deadlock (ray#44687), so Ray Data is capped at what the workers leave. The cap used to be fixed
once before the first worker existed: on a cluster that autoscales from a head alone, that was the 0.5-CPU floor
for the whole run, whatever machines came later. ``PlanDataConfig.configure`` (called by Ray Train at every
worker-group start) sizes it here again from the nodes alive then, and says so as the ``data_share`` unit.

The preprocessing calibration has the same flaw: it times Ray Data's tasks at the driver's start, on the CPUs
Ray Data had then (on a head alone, the floor), and its tasks in flight were then split over however many ranks
a start had. Each start now times it again when the CPUs it leaves Ray Data differ more than
:data:`CALIBRATE_AGAIN_RATIO` times from the calibration's (:func:`calibrate_again`; the calibration cache makes
a later start of the same shape free), and otherwise scales the calibrated tasks in flight by them
(:func:`start_concurrency`): the calibration's tasks per CPU, not its count, is what carries across a resize.
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


def start_concurrency(calibrated: int | None, calibrated_cpus: float | None,
                      data_cpus: float) -> tuple[int | None, str]:
    """(tasks in flight for all ranks at this start, why): ``calibrated`` tasks measured best on
    ``calibrated_cpus`` CPUs, scaled to the ``data_cpus`` this start leaves Ray Data; a pinned or default
    concurrency (``calibrated_cpus`` None) stands."""
    if not calibrated or not calibrated_cpus:
        return calibrated, ("data.preprocess_concurrency as given" if calibrated else "Ray Data's default")
    now = max(1, round(calibrated * data_cpus / calibrated_cpus))
    return now, (f"the calibration's {calibrated} tasks on {calibrated_cpus:g} CPUs, scaled to this start's "
                 f"{data_cpus:g}")


CALIBRATE_AGAIN_RATIO = 2.0  # a start whose Ray Data CPUs differ more than this from the calibration's re-times


def calibrate_again(calibrated_cpus: float | None, data_cpus: float) -> bool:
    """Whether a start's ``data_cpus`` are too far from the calibration's for its curve to say anything: a curve
    timed on the 0.5-CPU floor of a head alone has one point, not the knee of a cluster of GPU machines."""
    if not calibrated_cpus:
        return False
    return max(data_cpus / calibrated_cpus, calibrated_cpus / data_cpus) > CALIBRATE_AGAIN_RATIO


def describe(share: dict[str, Any], world_size: int, nodes: int) -> str:
    return (f"Ray Data gets {share['data_cpus']:g} of the cluster's {share['cluster_cpus']:g} CPUs "
            f"({world_size} workers on {nodes} node(s) hold {share['train_cpus']:g}), sized at this worker-group "
            f"start")
