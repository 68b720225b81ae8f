"""Where JPEG tiers are decoded under ``data.decode_on=auto``: the placement that leaves the
*training* rate higher wins (device decode adds to the step's device time, CPU decode costs the GPU nothing),
the CPUs are counted as the physical cores behind Ray's CPU resource, and the nvJPEG probe runs in a one-GPU Ray
task, never in the driver (a cluster without GPUs is not probed at all)."""

from __future__ import annotations

import json
from functools import partial

import psutil
import pytest
import ray
import torch
import torch.distributed as dist

from lightray.data import autotune, start_decode
from lightray.data.autotune import data_cores_per_gpu, estimate_decode, pick_decode
from lightray.data.ingest import plan_decode
from lightray.data.manifest import Manifest
from tests.small_tiers import one_phase_spec, prepared_tier

RES = 48


@pytest.fixture(scope="module")
def jpeg_manifest(tmp_path_factory) -> Manifest:
    # A local cluster without GPUs (2 CPUs); raw_max_resolution=0 stores the tier as JPEG.
    yield from prepared_tier(tmp_path_factory.mktemp("decode-placement"), raw_max_resolution=0)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_gpu_decode_faster_than_the_cpus_but_slowing_the_step_keeps_the_cpu_path():
    # One GPU decodes 5,000 img/s, more than the 300 img/s x 12 cores = 3,600 the CPUs feed; but the model trains
    # at 2,500 img/s, which the CPUs feed in full, while decoding on its GPU slows it to 1/(1/2500 + 1/5000).
    # A rule comparing the decode rates alone (5,000 against 3,600) would take the device.
    assert pick_decode(300.0, 5000.0, 12.0, 2500.0) == "cpu"


def test_the_model_takes_the_cpu_when_device_decode_costs_training_more_than_the_cpus_lack():
    est = estimate_decode(300.0, 5000.0, 12.0, model_img_s=2500.0)
    assert est.on == "cpu" and est.cpu_feed_img_s == pytest.approx(3600.0)
    assert est.train_img_s == {"cpu": 2500.0, "device": pytest.approx(1666.7, abs=0.1)}
    assert est.break_even_img_s == pytest.approx(3600 * 5000 / 1400)  # device wins only above 12,857 img/s
    for text in ("model:", "min(T, C) = min(2500, 300 x 12) = 2500", "1/(1/2500 + 1/5000) = 1667",
                 "data.decode_model_img_s"):
        assert text in est.rule, est.rule
    # CPUs slower than the GPU path can feed, even counting what it costs the step: 1,667 > 2 cores x 300.
    est = estimate_decode(300.0, 5000.0, 2.0, model_img_s=2500.0)
    assert est.on == "device" and est.train_img_s == {"cpu": 600.0, "device": pytest.approx(1666.7, abs=0.1)}
    # A fast model (above the break-even rate) is worth the decode's share of its GPU.
    assert pick_decode(300.0, 5000.0, 12.0, 20000.0) == "device"
    # A GPU decoding no faster than the CPUs feed never wins, whatever the model.
    assert estimate_decode(300.0, 3000.0, 12.0, 1e6).on == "cpu"
    assert estimate_decode(300.0, 3000.0, 12.0).break_even_img_s is None


def test_an_unknown_model_rate_is_stated_and_decided_by_the_smaller_worst_case_loss():
    # Unknown T: the device only when G > 1.618 C (C = 3,600 here, so 5,825 img/s).
    est = estimate_decode(300.0, 5000.0, 12.0)
    assert est.on == "cpu" and est.train_img_s is None
    assert "unknown (data.decode_model_img_s=0)" in est.rule and "12857 img/s per GPU" in est.rule, est.rule
    assert pick_decode(300.0, 6000.0, 12.0) == "device"
    # At the golden ratio the two worst cases are equal: CPU loses 1 - C/G (T unbounded), device C/(C+G) (T = C).
    g_over_c = autotune.UNKNOWN_MODEL_RATIO
    assert 1 - 1 / g_over_c == pytest.approx(1 / (1 + g_over_c))


def test_physical_cores_behind_rays_cpus():
    # A node whose Ray CPU resource is twice its cores (lightray's local cluster on a machine without SMT, or
    # Ray's default of logical CPUs on a hyperthreaded one): 2 units of CPU per GPU are 1 core.
    assert data_cores_per_gpu(2.0, [(8.0, 4)]) == pytest.approx(1.0)
    # lightray's local cluster (2 x logical) on a hyperthreaded 16-core machine: 64 CPUs, 16 cores.
    assert data_cores_per_gpu(60.0, [(64.0, 16)]) == pytest.approx(15.0)
    # A node offering fewer CPUs than it has cores gives at most one core per CPU; nodes add up.
    assert data_cores_per_gpu(4.0, [(4.0, 8)]) == pytest.approx(4.0)
    assert data_cores_per_gpu(10.0, [(8.0, 4), (12.0, 12)]) == pytest.approx(10.0 * 16 / 20)
    assert data_cores_per_gpu(3.0, []) == pytest.approx(3.0)


def test_node_cores_counts_the_physical_cores_of_each_node_with_cpus(jpeg_manifest):
    nodes = autotune.node_cores()
    assert nodes == [(ray.cluster_resources()["CPU"], psutil.cpu_count(logical=False))]
    here = ray.get_runtime_context().get_node_id()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # The task that counts another node's cores, pinned here: the same count as in this process.
    task = autotune._node_cores_task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False))
    assert ray.get(task.remote(), timeout=60) == autotune.physical_cores()


def test_the_gpu_probe_is_a_one_gpu_ray_task_and_a_cluster_without_gpus_is_not_probed(jpeg_manifest, tmp_path):
    opts = autotune.device_probe._default_options
    assert opts["num_gpus"] == 1 and opts["max_calls"] == 1  # its own process, gone (with its context) after
    spec = one_phase_spec(jpeg_manifest, str(tmp_path / "local"), RES)
    assert ray.cluster_resources().get("GPU", 0) == 0
    measured: list[int] = []
    choice = autotune.choose_decode(spec, 0, "auto", True, cpus_per_gpu=2.0, seconds=0.2,
                                    before_measure=lambda: measured.append(1), model_img_s=1500.0)
    assert choice.on == "cpu" and "no GPU in the cluster yet" in choice.reason and "probe was not run" in choice.reason
    # The CPU path is timed all the same: each worker-group start decides again with it (app/data/start_decode.py).
    assert choice.device_img_s is None and choice.cpu_img_s_per_cpu > 0 and measured == [1]
    assert autotune.cuda_decode_rate([b"\xff\xd8"]) == (None, "no GPU in the cluster (the nvJPEG probe was not run)")
    assert not torch.cuda.is_initialized()  # the driver holds no CUDA context
    plan_decode(spec, "auto", True, cpus_per_gpu=2.0, seconds=0.2, model_img_s=1500.0)
    ev = [e for e in spec.events if e["unit"] == "decode_on"][-1]
    assert ev["on"] == "cpu" and ev["model_img_s"] == 1500.0 and "no GPU in the cluster" in ev["message"]
    assert "decided again at each worker-group start" in ev["message"]
    rates = spec.phases[0].decode_rates  # what each worker-group start decides with
    assert rates["device_img_s"] is None and rates["cpu_img_s_per_cpu"] > 0 and rates["model_img_s"] == 1500.0


@pytest.fixture
def runlog(tmp_path):
    """The run's log actor, as a run has it: the data plan's records go there and rank 0's timing comes from it."""
    from lightray.report.runlog import start_runlog

    actor = start_runlog("start-decode-test", str(tmp_path / "run"), tensorboard=False)
    yield actor
    ray.kill(actor)


def _records(runlog, unit: str) -> list[dict]:
    return [r for r in map(json.loads, open(ray.get(runlog.flush.remote()))) if r.get("unit") == unit]


def _start(config, world: int) -> list[str]:
    """One worker-group start as Ray Train makes it (a fresh copy of the data config, configured for ``world``
    ranks); the keys of rank 0's first batch."""
    from lightray.data.ingest import make_blocks_dataset, phase_blocks

    start = ray.cloudpickle.loads(ray.cloudpickle.dumps(config))
    node = ray.get_runtime_context().get_node_id()
    its = start.configure({"train_p0": make_blocks_dataset(phase_blocks(start.spec, 0, 0, 0))}, world, None,
                          [node] * world)
    return sorted(next(iter(its[0]["train_p0"].iter_batches(batch_size=4, batch_format="numpy"))))


def _plan_config(spec):
    from lightray.data.ingest import PlanDataConfig
    from lightray.driver.runner import record_to_runlog
    from lightray.report.runlog import latest_unit

    return PlanDataConfig(spec, cpus_per_worker=0.5, record=partial(record_to_runlog, "start-decode-test"),
                          probe=partial(latest_unit, "start-decode-test", start_decode.PROBE_UNIT))


def test_a_run_planned_with_no_gpu_up_decides_decode_at_each_worker_group_start_from_the_group_it_got(
        jpeg_manifest, tmp_path, runlog):
    """The driver of a GPU run on a cluster that autoscales from a head alone plans with no GPU up: it used to
    keep the CPU path for the whole run. Each start now decides from rank 0's decode timing and the cores its
    group leaves Ray Data per GPU: here a GPU whose decode rate lies between what one worker's and three workers'
    CPU shares feed (x the golden ratio), so a start of one worker keeps the CPU path and a start of three decodes
    on the workers' device; the map tasks ship pixels, then JPEG bytes."""
    spec = one_phase_spec(jpeg_manifest, str(tmp_path / "local"), RES)
    plan_decode(spec, "auto", True, cpus_per_gpu=2.0, seconds=0.2)  # the driver, with no GPU in the cluster
    assert start_decode.needs_probe(spec) == [spec.phases[0]] and not spec.phases[0].device_decode
    cpu_rate = spec.phases[0].decode_rates["cpu_img_s_per_cpu"]
    nodes, total = autotune.node_cores(), ray.cluster_resources()["CPU"]
    cores = {w: autotune.data_cores_per_gpu(max(0.5, total - w * 0.5) / w, nodes) for w in (1, 3)}
    gpu_rate = autotune.UNKNOWN_MODEL_RATIO * cpu_rate * (cores[1] + cores[3]) / 2  # a GPU's, as rank 0 logs it
    ray.get(runlog.log.remote({"event": "unit", "unit": start_decode.PROBE_UNIT, "device": "cuda:0",
                               "device_img_s": {start_decode.key_of(spec.phases[0]): gpu_rate}}))
    keys = {w: _start(_plan_config(spec), w) for w in (1, 3)}
    decided = _records(runlog, "decode_on")
    assert [(r["world_size"], r["gpus"], r["on"], r["start"]) for r in decided] == [
        (1, 1, "cpu", True), (3, 3, "device", True)], decided
    assert [r["cores_per_gpu"] for r in decided] == pytest.approx([cores[1], cores[3]], rel=1e-2)
    assert all(r["device_img_s"] == gpu_rate and "rank 0 on cuda:0" in r["message"] for r in decided)
    assert "image" in keys[1] and "jpeg" not in keys[1]  # the CPU path: decoded, cropped pixels
    assert "jpeg" in keys[3] and "box" in keys[3]  # device decode: bytes passed through with the crop boxes
    assert len(_records(runlog, "data_share")) == 2  # said beside the data share, once per start
    assert not spec.phases[0].device_decode  # each start decided on its own copy; the driver's spec is untouched


def test_a_start_without_rank_zeros_decode_timing_keeps_the_cpu_path_and_says_why(jpeg_manifest, tmp_path, runlog):
    spec = one_phase_spec(jpeg_manifest, str(tmp_path / "local"), RES)
    plan_decode(spec, "auto", True, cpus_per_gpu=2.0, seconds=0.2)
    keys = _start(_plan_config(spec), 2)
    decided = _records(runlog, "decode_on")
    assert [(r["on"], r["device_img_s"]) for r in decided] == [("cpu", None)]
    assert "no measurement of the workers' device decode" in decided[0]["message"] and "image" in keys


def test_rank_zero_times_decode_on_its_device_and_the_run_log_hands_the_timing_to_the_start(
        jpeg_manifest, tmp_path):
    """The worker side: a trainer whose spec awaits a GPU timing measures decode_jpeg on its own device (the CPU
    device here) before any dataset is asked for, and the run's log actor returns it to the data plan."""
    from lightray.report.runlog import latest_unit, start_runlog
    from lightray.train.trainer import RunLogReporter

    spec = one_phase_spec(jpeg_manifest, str(tmp_path / "local"), RES)
    plan_decode(spec, "auto", True, cpus_per_gpu=2.0, seconds=0.2)
    record = start_decode.probe_on_worker(spec, torch.device("cpu"), seconds=0.2)
    rate = record["device_img_s"][start_decode.key_of(spec.phases[0])]
    assert rate > 0 and record["device"] == "cpu" and "rank 0 timed decode_jpeg on cpu" in record["message"]
    runlog = start_runlog("probe-test", str(tmp_path / "run"), tensorboard=False)
    try:
        assert latest_unit("probe-test", start_decode.PROBE_UNIT) is None
        RunLogReporter("probe-test", 0).logged(record)  # returns once the log holds it: no wait needed after
        got = latest_unit("probe-test", start_decode.PROBE_UNIT)
    finally:
        ray.kill(runlog)
    assert got["device_img_s"] == record["device_img_s"] and "time" in got
    decided = start_decode.plan_start(spec, 1, 2.0, got, autotune.node_cores())
    assert decided[0]["device_img_s"] == rate and "rank 0 on cpu" in decided[0]["message"]


def test_a_trainer_probes_only_when_its_spec_awaits_a_gpu_timing(jpeg_manifest, tmp_path, one_rank_group):
    from lightray.comm.topology import Topology
    from lightray.config import load_config
    from lightray.train.trainer import Trainer

    cfg = load_config("smoke", {"schedule.phases": f"[{{until: 1.0, resolution: {RES}, batch_size: 16}}]"})
    for pending in (False, True):
        spec = one_phase_spec(jpeg_manifest, str(tmp_path / "local"), RES)
        plan_decode(spec, "auto", pending, cpus_per_gpu=2.0, seconds=0.2)  # CPU workers: decided once, no rates
        records: list[dict] = []
        trainer = Trainer(cfg, spec, str(tmp_path / "run"), 3, rank=0, world=1, topology=Topology(1, 0, 0, 1, 0, 1),
                          report=records.append)
        trainer._probe_decode()
        probes = [r for r in records if r.get("unit") == start_decode.PROBE_UNIT]
        assert len(probes) == int(pending), records
    assert probes[0]["device"] == "cpu" and probes[0]["device_img_s"][start_decode.key_of(spec.phases[0])] > 0


@pytest.mark.slow  # a cluster of its own
@pytest.mark.shares_cpu
@pytest.mark.own_cluster
def test_auto_on_a_gpu_cluster_probes_in_a_ray_task_and_leaves_the_driver_cuda_free(jpeg_manifest, tmp_path):
    # A cluster that declares one GPU on a machine without one: the whole auto path runs (CPU timing, core count,
    # the probe scheduled as a one-GPU task), the probe's CUDA decode fails in its own process, and the driver
    # keeps the CPU path without having touched CUDA. Last in the module: it replaces the module's cluster.
    ray.shutdown()
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        spec = one_phase_spec(jpeg_manifest, str(tmp_path / "local"), RES)
        choice = autotune.choose_decode(spec, 0, "auto", True, cpus_per_gpu=4.0, seconds=0.2)
        assert choice.on == "cpu" and "the GPU probe failed" in choice.reason, choice.reason
        assert choice.cpu_img_s_per_cpu and choice.cpu_img_s_per_cpu > 0
        assert choice.cores_per_gpu == pytest.approx(4.0 * min(2.0, psutil.cpu_count(logical=False)) / 2.0)
        assert not torch.cuda.is_initialized()
    finally:
        ray.shutdown()
