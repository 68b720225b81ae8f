"""Where JPEG tiers are decoded under ``data.decode_on=auto``: the placement that leaves the
*training* rate higher wins (device decode adds to the step's device time, CPU decode costs the GPU nothing),
the CPUs are counted as the physical cores behind Ray's CPU resource, and the nvJPEG probe runs in a one-GPU Ray
task, never in the driver (a cluster without GPUs is not probed at all)."""

from __future__ import annotations

import time

import psutil
import pytest
import ray
import torch

from lightray.data import autotune
from lightray.data.autotune import data_cores_per_gpu, estimate_decode, pick_decode
from lightray.data.ingest import plan_decode
from lightray.data.manifest import Manifest
from tests.small_tiers import one_phase_spec, prepared_tier

RES = 48


@pytest.fixture(scope="module")
def jpeg_manifest(tmp_path_factory) -> Manifest:
    # A local cluster without GPUs (2 CPUs); raw_max_resolution=0 stores the tier as JPEG.
    yield from prepared_tier(tmp_path_factory.mktemp("decode-placement"), raw_max_resolution=0)


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
    t0 = time.perf_counter()
    choice = autotune.choose_decode(spec, 0, "auto", True, cpus_per_gpu=2.0, seconds=0.2,
                                    before_measure=lambda: measured.append(1), model_img_s=1500.0)
    assert choice.on == "cpu" and "no GPU in the cluster" in choice.reason and "probe was not run" in choice.reason
    assert choice.device_img_s is None and choice.cpu_img_s_per_cpu is None and measured == []  # nothing timed
    assert time.perf_counter() - t0 < 2.0
    assert autotune.cuda_decode_rate([b"\xff\xd8"]) == (None, "no GPU in the cluster (the nvJPEG probe was not run)")
    assert not torch.cuda.is_initialized()  # the driver holds no CUDA context
    plan_decode(spec, "auto", True, cpus_per_gpu=2.0, seconds=0.2, model_img_s=1500.0)
    ev = [e for e in spec.events if e["unit"] == "decode_on"][-1]
    assert ev["on"] == "cpu" and ev["model_img_s"] == 1500.0 and "no GPU in the cluster" in ev["message"]


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
