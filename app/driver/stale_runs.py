"""Free what a dead driver of this run still books on the cluster, so that a resumed run starts in seconds.

When a driver dies, Ray ends its job at once: its actors are killed and its placement groups removed. One
thing outlives it: Ray Train's controller books its worker group's resources with the cluster-wide
``AutoscalingCoordinator`` (a detached actor shared with Ray Data, requester ``train-<Train run id>``), and
that booking lapses only 180 s after the controller's last renewal. Until then the elastic scaling policy of
the resumed run's new controller sees the resources as booked by another run and finds "ready resources for
0 workers": on the chaos bench's cluster the first step came 195 s after the driver was killed.

So rank 0 writes its Ray Train run id into each start and restart record of ``metrics.jsonl``, and a driver
that starts a run cancels the bookings of every Train run id its records name: each belongs to an earlier
driver of this run, and the run lock, taken first, guarantees that none of them is alive. (Ray Train's own
run registry, its state actor, exists only with ``RAY_TRAIN_ENABLE_STATE_TRACKING=1``.)
"""

from __future__ import annotations

import logging
import os
from typing import Any

from lightray import ray_private

log = logging.getLogger("lightray")
CALL_TIMEOUT_S = 10.0


def recorded_run_ids(records: list[dict[str, Any]]) -> list[str]:
    """The Train run ids of the start and restart records of a run's metrics, oldest first, each once."""
    ids = [r.get("train_run_id") for r in records if r.get("event") in ("start", "restart")]
    return list(dict.fromkeys(i for i in ids if i))


def release_bookings(run_ids: list[str]) -> list[str]:
    """Cancel the coordinator's bookings of these (dead) Train runs; returns the ids asked for. A cluster
    without a coordinator (no Train run has booked anything on it) has nothing to release."""
    import ray

    if not run_ids:
        return []
    try:
        name, namespace = ray_private.AUTOSCALING_COORDINATOR  # checked against the pinned Ray at start-up
        coordinator = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return []
    ray.get([coordinator.cancel_request.remote(requester_id=f"train-{i}") for i in run_ids], timeout=CALL_TIMEOUT_S)
    log.info("cancelled the resource bookings of earlier Train runs %s (pid %d)", run_ids, os.getpid())
    return run_ids
