"""A resuming driver cancels what its dead predecessors booked with Ray's autoscaling coordinator
(app/driver/stale_runs.py), on a real local Ray cluster and the real coordinator actor. The whole path (a killed
driver, then ``--resume`` on a multi-node cluster) is bench.chaos's driver_kill, in tests/test_chaos_bench.py."""

from __future__ import annotations

from lightray.driver.stale_runs import recorded_run_ids, release_bookings


def _bookings(coordinator) -> set[str]:
    import ray

    return set(ray.get(coordinator.__ray_call__.remote(lambda self: list(self._ongoing_reqs))))


def test_the_run_ids_of_every_recorded_start_are_found_once_in_order():
    records = [{"event": "start", "train_run_id": "a"}, {"step": 1}, {"event": "resize", "train_run_id": "x"},
               {"event": "restart", "train_run_id": "a"}, {"event": "restart", "train_run_id": "b"},
               {"event": "restart"}]  # a run in the driver's own process records none
    assert recorded_run_ids(records) == ["a", "b"]


def test_a_dead_attempts_booking_is_cancelled_and_a_live_one_kept(ray_local):
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
        TrainAutoscalingCoordinatorClient,
    )

    assert release_bookings(["nothing-booked"]) in ([], ["nothing-booked"])  # no coordinator yet, or no booking
    for run_id in ("dead", "live"):  # what Ray Train's controller of each attempt books (HIGH priority, 180 s)
        TrainAutoscalingCoordinatorClient(f"train-{run_id}").send_resource_request(ScalingConfig(num_workers=1), 1)
    coordinator = get_or_create_autoscaling_coordinator()
    assert {"train-dead", "train-live"} <= _bookings(coordinator)
    assert release_bookings(["dead"]) == ["dead"]
    left = _bookings(coordinator)
    assert "train-dead" not in left and "train-live" in left
    release_bookings(["live"])
