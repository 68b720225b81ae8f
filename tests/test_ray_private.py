"""lightray.ray_private: the Ray internals lightray needs, checked against the pinned Ray."""

import socket

from lightray import ray_private


def test_every_private_name_is_there_in_the_pinned_ray():
    assert ray_private.check() == []


def _address_file(tmp_path):
    return tmp_path / "ray_current_cluster"


def test_a_current_cluster_file_naming_a_dead_address_is_removed(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    _address_file(tmp_path).write_text(dead)
    assert ray_private.drop_stale_cluster_address(str(tmp_path)) == dead
    assert not _address_file(tmp_path).exists()


def test_a_current_cluster_file_naming_a_live_address_is_kept(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        live = f"127.0.0.1:{s.getsockname()[1]}"
        _address_file(tmp_path).write_text(live)
        assert ray_private.drop_stale_cluster_address(str(tmp_path)) is None
    assert _address_file(tmp_path).read_text() == live


def test_no_current_cluster_file_is_nothing_to_do(tmp_path):
    assert ray_private.drop_stale_cluster_address(str(tmp_path)) is None


def test_the_pinned_ray_gives_an_error_marked_preempted_its_own_budget():
    assert ray_private.preemption_has_its_own_budget() is True


def test_a_spot_notice_is_charged_to_the_preemption_budget_and_a_real_error_to_max_failures():
    """lightray's PreemptedError, as it reaches Ray Train's controller (pickled), against Ray's own failure policy
    with no failure allowed: any number of notices are retried, one real error ends the run."""
    import pickle

    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy
    from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
    from ray.train.v2.api.exceptions import WorkerGroupError

    from lightray.train.trainer import PreemptedError

    policy = DefaultFailurePolicy(FailureConfig(max_failures=0, max_preemption_failures=-1))
    notice = pickle.loads(pickle.dumps(PreemptedError("node preemption notice X; checkpoint written")))
    assert "node preemption notice X" in str(notice)
    for _ in range(3):
        group = WorkerGroupError(error_message="notice", worker_failures={0: notice, 1: notice})
        assert policy.make_decision(group) == FailureDecision.RETRY
    bug = WorkerGroupError(error_message="bug", worker_failures={0: RuntimeError("a real error")})
    assert policy.make_decision(bug) == FailureDecision.RAISE


def test_a_private_interface_that_moved_is_named_in_a_warning_with_the_pinned_version(monkeypatch, caplog):
    """The coordinator's name is read against Ray's own source: a name Ray no longer uses is reported, loudly."""
    monkeypatch.setattr(ray_private, "AUTOSCALING_COORDINATOR", ("RenamedCoordinator", "AutoscalingCoordinator"))
    with caplog.at_level("WARNING", logger="lightray.ray_private"):
        missing = ray_private.check()
    assert len(missing) == 1 and "('RenamedCoordinator', 'AutoscalingCoordinator')" in missing[0], missing
    (record,) = caplog.records
    assert "lightray was written for Ray 2.60" in record.getMessage() and "RenamedCoordinator" in record.getMessage()


def test_the_placement_group_job_id_is_the_one_ray_built_it_from():
    from ray._raylet import JobID, PlacementGroupID

    for n in (1, 7, 2**20):
        job = JobID.from_int(n)
        assert ray_private.placement_group_job_id(PlacementGroupID.of(job).hex()) == job.hex()


def test_the_recorded_cluster_is_the_current_cluster_files_address_and_none_without_one(tmp_path):
    assert ray_private.recorded_cluster_address(str(tmp_path)) is None
    _address_file(tmp_path).write_text("")
    assert ray_private.recorded_cluster_address(str(tmp_path)) is None
    _address_file(tmp_path).write_text("10.0.0.5:6379\n")
    assert ray_private.recorded_cluster_address(str(tmp_path)) == "10.0.0.5:6379"
