"""``scaling.warm_data_workers``: a rank's warm-up tasks leave idle processes that its stream's first map tasks run in.

Each rank is played by an actor with a runtime environment of its own (as a Ray Train worker has, with its
``RAY_TRAIN_*`` variables): only processes started under it can take its stream's tasks, so the session cluster's
other idle workers cannot stand in for the warmed ones.
"""

from __future__ import annotations

import os
import uuid

import pytest

from tests.faults import records

pytestmark = pytest.mark.timeout(120)


def _rank_actor(ray):
    @ray.remote(num_cpus=0)
    class Rank:
        def stream_pids(self, warm: str) -> dict:
            import numpy as np

            from lightray.data import warm_workers

            def map_pid(batch):  # defined here: the test module itself is not importable in Ray's workers
                return {"pid": np.full(len(batch["id"]), os.getpid())}

            refs = warm_workers.start(warm_workers.count(warm, False, None, 1), 0.5)
            ray.wait(refs, num_returns=len(refs), timeout=60)  # the model's build, in a real start
            said = warm_workers.describe(refs, warm, False, 0.5)
            ds = ray.data.range(8, override_num_blocks=4).map_batches(
                map_pid, num_cpus=0.5, compute=ray.data.TaskPoolStrategy(size=1))
            pids = {int(p) for b in ds.iterator().iter_batches(batch_size=None) for p in b["pid"]}
            return {"said": said, "pids": sorted(pids), "own": os.getpid()}

    # A runtime environment no other test has: the warmed processes are the only idle ones that fit.
    return Rank.options(runtime_env={"env_vars": {"LIGHTRAY_TEST_RANK_ENV": uuid.uuid4().hex}}).remote()


def test_the_first_map_tasks_of_a_rank_run_in_the_processes_it_warmed(ray_local):
    ray = ray_local
    warmed = ray.get(_rank_actor(ray).stream_pids.remote("1"))
    said = warmed["said"]
    assert said["enabled"] and said["started"] == 1 and said["ready"] == 1, said
    assert "1 ready before the first batch" in said["message"]
    assert warmed["pids"] and set(warmed["pids"]) <= set(said["pids"]), warmed

    cold = ray.get(_rank_actor(ray).stream_pids.remote("auto"))  # the same stream with the unit off
    assert not cold["said"]["enabled"] and cold["said"]["message"].startswith("off (auto: a CPU worker")
    assert not set(cold["pids"]) & set(said["pids"]), (cold, warmed)


@pytest.mark.parametrize("setting,gpu,tasks,world,expected", [
    ("1", False, 4, 2, 1), ("4", False, 4, 2, 2), ("4", False, 5, 2, 3), ("2", False, None, 8, 1), ("0", True, 4, 2, 0),
    ("auto", True, 8, 2, 1), ("auto", False, 8, 2, 0)])
def test_a_rank_warms_its_share_of_the_tasks_in_flight_up_to_the_setting_and_auto_only_on_a_gpu(setting, gpu, tasks,
                                                                                                   world, expected):
    from lightray.data.warm_workers import count

    assert count(setting, gpu, tasks, world) == expected


def test_each_rank_of_a_run_warms_a_data_worker_before_its_first_batch_and_says_so(finished_run):
    [unit] = [r for r in records(finished_run) if r.get("unit") == "warm_data_workers"]  # rank 0's start
    assert unit["enabled"] and unit["started"] == 1 and unit["ready"] == len(unit["pids"]) <= 1, unit
    assert unit["message"].startswith("1 task worker process(es) x "), unit


@pytest.mark.parametrize("setting,gpu,why", [("0", True, "scaling.warm_data_workers=0"),
                                             ("auto", False, "auto: a CPU worker"),
                                             ("auto", True, "no Ray Train worker here")])
def test_a_rank_that_warms_nothing_says_why(setting, gpu, why):
    from lightray.data.warm_workers import describe

    said = describe([], setting, gpu, 0.5)
    assert not said["enabled"] and said["message"].startswith(f"off ({why}"), said
