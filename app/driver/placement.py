"""Can the Train worker group be placed, and what is it waiting for when it cannot?

Ray Train waits for its workers' placement group without a word: on a machine without GPUs,
``--gpu true`` used to print the data-cache lines and then nothing, forever. Two answers:

- :func:`check_local_fit` before ``fit()``, when this run started its own (local, one-node) cluster:
  nothing can ever add resources, so if the minimum number of workers does not fit the cluster's
  totals, the run stops at once with one line (a :class:`PlacementError`, which the command line turns
  into exit status 2).
- :class:`WaitReporter` on a cluster the run joined (an autoscaler may add nodes): while a placement
  group of this job is pending, every few seconds one line says what it waits for (workers x resources),
  what the cluster has in total and free, and that only the autoscaler can add nodes.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, TextIO

from lightray.config import ConfigError


class PlacementError(ConfigError):
    """The worker group can never be placed on this cluster."""


def worker_request(cpus_per_worker: float, extra: dict[str, float], use_gpu: bool) -> dict[str, float]:
    """The resources one Train worker asks for (Ray Train adds one GPU per worker with ``use_gpu``)."""
    req = {"CPU": float(cpus_per_worker), **{k: float(v) for k, v in extra.items()}}
    if use_gpu:
        req.setdefault("GPU", 1.0)
    return {k: v for k, v in req.items() if v > 0}


def fmt(resources: dict[str, float]) -> str:
    keep = {k: v for k, v in resources.items() if not k.startswith(("node:", "accelerator_type:"))
            and k not in ("memory", "object_store_memory")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(keep.items())) + "}"


def shortfall(request: dict[str, float], workers: int, total: dict[str, float]) -> dict[str, float]:
    """Per resource, how much ``workers`` x ``request`` exceeds ``total`` (empty when it fits)."""
    return {k: v * workers - total.get(k, 0.0) for k, v in request.items() if v * workers > total.get(k, 0.0) + 1e-9}


def check_local_fit(request: dict[str, float], min_workers: int, total: dict[str, float]) -> None:
    """Raise :class:`PlacementError` when ``min_workers`` x ``request`` exceeds a cluster that cannot grow."""
    short = shortfall(request, min_workers, total)
    if not short:
        return
    hint = ("--gpu false (or auto) trains on CPUs; --scaling.ray_address=ADDRESS joins a cluster with GPUs"
            if "GPU" in short else "fewer --workers, smaller --scaling.cpus_per_worker or a larger "
            "--scaling.ray_num_cpus, or --scaling.ray_address=ADDRESS to join a bigger cluster")
    raise PlacementError(
        f"scaling: {min_workers} workers x {fmt(request)} cannot be placed: this run's local cluster has "
        f"{fmt(total)} in total and no autoscaler to add nodes (short by {fmt(short)}); {hint}")


def _pending_groups() -> list[dict[str, Any]]:
    from ray.util import placement_group_table

    try:
        table = placement_group_table()
    except Exception:  # the GCS is busy or going away: say nothing this round
        return []
    return [pg for pg in table.values() if pg.get("state") in ("PENDING", "RESCHEDULING")]


def _draining() -> tuple[int, dict[str, float]]:
    """How many machines are draining (a spot notice, an idle machine being removed), and what they hold: Ray
    counts them in the cluster's totals and free resources, but places nothing new on them."""
    import ray

    from lightray import ray_private

    try:
        ids = ray_private.draining_node_ids()
        nodes = ray.nodes() if ids else []
    except Exception:  # the GCS is busy or going away: say nothing of it this round
        return 0, {}
    held: dict[str, float] = {}
    count = 0
    for node in nodes:
        if node.get("Alive") and node["NodeID"] in ids:
            count += 1
            for key, value in node.get("Resources", {}).items():
                held[key] = held.get(key, 0.0) + value
    return count, held


class WaitReporter:
    """Prints, every ``every_s`` seconds while a placement group waits, what the worker group waits for."""

    def __init__(self, request: dict[str, float], workers: str, every_s: float = 10.0,
                 stream: TextIO | None = None, can_grow: bool = True):
        self.request, self.workers, self.every_s = request, workers, every_s
        self.stream = stream or sys.stdout
        self.can_grow = can_grow
        self.lines = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lightray-placement", daemon=True)

    def start(self) -> WaitReporter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def describe(self, pending: int) -> str:
        import ray

        total, free = ray.cluster_resources(), ray.available_resources()
        draining, held = _draining()
        # A group waiting while the cluster looks free is often waiting on a draining machine (CI, 2026-12-07).
        on_draining = (f" (of which {fmt(held)} on {draining} draining machine(s), where nothing new is placed)"
                       if draining else "")
        grow = ("an autoscaler, if the cluster has one, may add nodes with these resources (`ray status` shows "
                "its pending launches)" if self.can_grow else "nothing will add nodes to this cluster")
        return (f"waiting for the worker group: {self.workers} workers x {fmt(self.request)} "
                f"({pending} placement group(s) pending); the cluster has {fmt(total)} in total, {fmt(free)} free"
                f"{on_draining}; "
                f"{grow}")

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            pending = _pending_groups()
            if pending:
                try:
                    print(self.describe(len(pending)), file=self.stream, flush=True)
                    self.lines += 1
                except Exception:  # the cluster went away mid-run; fit() reports that
                    return
