"""The preprocessing calibration is measured once per data and machine: a second start-up on the same
shards reuses the stored answer instead of timing again, and a change of data or machine misses."""

from __future__ import annotations

import os

import psutil
import pytest
import ray

from bench.pipeline import make_source
from lightray.data import autotune, autotune_cache


def _spec(tmp_path):
    from lightray.data.ingest import IngestSpec, PhaseSpec, tier_shards
    from lightray.data.manifest import Manifest
    from lightray.data.prepare import prepare

    src = make_source(tmp_path / "src", n_train=96, n_val=12, classes=3, size=(40, 30))
    m = Manifest.load(str(prepare(str(src), str(tmp_path / "cache"), [24], raw_max_resolution=0, shard_rows=32)))
    spec = IngestSpec(seed=1, local_dir=str(tmp_path / "local"), train_size=m.num_samples("train"),
                      phases=[PhaseSpec(0, 24, 24, 0.35, 0, 1, tier_shards(m, "train", 24))],
                      val=tier_shards(m, "val", 24), eval_resolution=24, val_crop_ratio=0.875)
    spec.train_size = autotune.MIN_CALIBRATION_SAMPLES  # enough samples to be worth calibrating
    return spec


@pytest.mark.slow  # two calibrations on Ray
@pytest.mark.shares_cpu
def test_second_start_reuses_the_calibration_of_the_same_data_on_this_machine(tmp_path, ray_local):
    spec = _spec(tmp_path)
    first = autotune.apply(spec, seconds=1.0, train_cpus=1.0)
    assert first.curve and "cached" not in first.reason
    again = _spec(tmp_path)  # a new run: same shards, same machine
    measured = []
    second = autotune.apply(again, seconds=1.0, train_cpus=1.0, before_measure=lambda: measured.append(1))
    assert "cached from a calibration" in second.reason, second.reason
    assert (second.concurrency, second.cpus, second.block_rows, second.curve) == \
        (first.concurrency, first.cpus, first.block_rows, first.curve)
    assert (again.map_concurrency, again.map_cpus, again.block_rows) == (first.concurrency, first.cpus,
                                                                        first.block_rows)
    assert measured == []  # the second start timed nothing
    # Both record the CPUs the calibration had, which each worker-group start scales the tasks in flight by.
    assert spec.map_concurrency_cpus == again.map_concurrency_cpus == autotune.data_cpus(1.0)


def test_calibration_cache_misses_for_other_data_or_another_machine(tmp_path, ray_local):
    spec = _spec(tmp_path)
    key = autotune_cache.key_for(spec, 0, 2.0, 1.0, None)
    assert autotune_cache.load(spec.local_dir, key) is None
    autotune_cache.save(spec.local_dir, key, {"concurrency": 2, "cpus": 1.0, "rows_per_task": 64, "curve": [],
                                              "reason": "r"})
    assert autotune_cache.load(spec.local_dir, key)["concurrency"] == 2
    assert key["machine"]["cluster_cpus"] == ray.cluster_resources()["CPU"]
    # cores are physical; Ray's CPUs (twice the logical CPUs on lightray's local cluster) are recorded apart
    assert key["machine"]["cores"] == psutil.cpu_count(logical=False)
    assert key["machine"]["logical_cpus"] == os.cpu_count()
    other_machine = dict(key, machine=dict(key["machine"], cores=key["machine"]["cores"] + 1))
    assert autotune_cache.load(spec.local_dir, other_machine) is None
    spec.phases[0].shards.sha256 = ["0" * 64] * len(spec.phases[0].shards.sha256)  # other shards
    assert autotune_cache.load(spec.local_dir, autotune_cache.key_for(spec, 0, 2.0, 1.0, None)) is None


def test_calibration_runs_from_inside_a_small_placement_group_like_a_search_trial(tmp_path, ray_local):
    # A Tune trial's placement group captures the tasks its process starts; it has no bundle for the
    # whole-core calibration tasks, which must run where Ray Data would run the map tasks they size.
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    spec = _spec(tmp_path)
    pg = placement_group([{"CPU": 0.1}, {"CPU": 0.5}])
    ray.get(pg.ready(), timeout=60)
    try:
        in_trial = ray.remote(num_cpus=0.1)(autotune.measure).options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_capture_child_tasks=True))
        rate = ray.get(in_trial.remote(spec, 0, 2, 1.0, 0.5, rows=16), timeout=120)
    finally:
        remove_placement_group(pg)
    assert rate > 0


def test_a_calibrated_plan_block_holds_one_tasks_rows_for_every_rank(tmp_path, ray_local):
    one = autotune.apply(_spec(tmp_path), seconds=1.0, train_cpus=1.0)
    spec = _spec(tmp_path)
    four = autotune.apply(spec, seconds=1.0, train_cpus=1.0, ranks=4)  # the same calibration, cached
    assert "cached from a calibration" in four.reason
    assert spec.block_rows == four.block_rows == 4 * one.block_rows
    assert "x 4 ranks" in spec.events[-1]["message"]


def test_a_start_far_from_the_calibrations_cpus_times_again_and_one_near_them_scales(tmp_path, ray_local):
    """Calibrated at the driver's start on the 0.5-CPU floor of a head alone (a curve of one point: one task), a
    worker-group start that leaves Ray Data far more CPUs times the curve again on them (its own copy of the
    spec takes the answer; the block rows stay); a start within 2x of the calibration's CPUs scales the tasks
    in flight by its CPUs instead."""
    from lightray.data.ingest import PlanDataConfig

    total = ray.cluster_resources()["CPU"]
    assert total - 0.5 > 2 * 0.5  # one worker of 0.5 CPU leaves Ray Data far more than the floor
    spec = _spec(tmp_path)
    spec.calibration_seconds = 0.5
    floor = autotune.apply(spec, seconds=0.5, train_cpus=total - 0.5)  # on the floor: what a head alone gives
    assert (floor.concurrency, spec.map_concurrency_cpus) == (1, 0.5)
    said: list[dict] = []
    start = PlanDataConfig(ray.cloudpickle.loads(ray.cloudpickle.dumps(spec)), 0.5, record=said.append)
    start.configure({}, 1, None, ["node"])
    far = said[-1]
    assert "calibrated again at this start, 0.5 CPUs then" in far["message"], far["message"]
    assert start.spec.map_concurrency_cpus == far["data_cpus"] == total - 0.5
    assert far["tasks_in_flight"] == start.spec.map_concurrency and far["task_cpus"] == start.spec.map_cpus
    assert start.spec.block_rows == spec.block_rows and spec.map_concurrency_cpus == 0.5  # the driver's is as was

    spec.map_concurrency, spec.map_concurrency_cpus = 4, (total - 0.5) / 1.5  # calibrated on 2/3 of the CPUs
    near = PlanDataConfig(ray.cloudpickle.loads(ray.cloudpickle.dumps(spec)), 0.5, record=said.append)
    near.configure({}, 1, None, ["node"])
    assert said[-1]["tasks_in_flight"] == 6 and "scaled to this start's" in said[-1]["message"]
