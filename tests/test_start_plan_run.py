"""The per-start decode plan through a real Ray Train worker group: a smoke run whose driver plans for CUDA
workers with no GPU in the cluster (as on a cluster that autoscales GPU machines from a head alone), so its
``data.decode_on=auto`` JPEG phases await rank 0's timing; the workers run on this machine's CPUs.

Its own run, not the shared finished one: the driver's plan must be shaped for GPU workers, which the shared
run is not. The shaping replaces one argument of lightray's planner (``workers_use_cuda``) and nothing of Ray
or torch: Ray Train's worker group, the dataset manager that plans each start, the run's log actor, Ray Data's
map tasks and the workers' ``decode_jpeg`` are all real.
"""

from __future__ import annotations

import json

import pytest

from lightray.config import load_config
from lightray.data import autotune

pytestmark = [pytest.mark.slow, pytest.mark.shares_cpu]  # one smoke run of 2 workers: about 40 s on 2 cores


def test_a_gpu_run_planned_with_no_gpu_up_times_decode_on_rank_0_and_places_it_at_its_start(
        tmp_path, ray_local, smoke_overrides, monkeypatch):
    import lightray.driver.runner as runner

    planner = runner.finalize_spec
    monkeypatch.setattr(runner, "finalize_spec", lambda spec, data, cpus, _cuda=False, shared=None, ranks=1:
                        planner(spec, data, cpus, True, shared, ranks=ranks))
    over = {**smoke_overrides, "storage": str(tmp_path), "name": "start-plan", "report.eval_sweep": [],
            "report.tensorboard": False, "data.decode_on": "auto", "data.memory_budget_mb": 0,
            "data.raw_max_resolution": 0}  # both phases JPEG, read from disk: both decided per start
    summary = runner.run_training(load_config("smoke", over), progress=False)
    assert summary["status"] == "finished", summary.get("error")
    recs = [json.loads(line) for line in (tmp_path / "start-plan" / "metrics.jsonl").read_text().splitlines()]
    probes = [i for i, r in enumerate(recs) if r.get("unit") == "decode_probe"]
    starts = [i for i, r in enumerate(recs) if r.get("unit") == "decode_on" and r.get("start")]
    driver = {r["phase"]: r for r in recs if r.get("unit") == "decode_on" and not r.get("start") and "phase" in r}
    assert len(probes) == 1 and len(starts) == 2 and probes[0] < min(starts), [r.get("unit") for r in recs]
    probe = recs[probes[0]]
    assert probe["device"] == "cpu" and all(v > 0 for v in probe["device_img_s"].values())
    for i in starts:
        r = recs[i]
        assert r["world_size"] == r["gpus"] == 2 and r["device_img_s"] in probe["device_img_s"].values()
        assert "no GPU in the cluster yet" in driver[r["phase"]]["message"]  # the driver could not decide
        rule = autotune.estimate_decode(r["cpu_img_s_per_cpu"], r["device_img_s"], r["cores_per_gpu"])
        assert r["on"] == rule.on, r  # the driver's rule, with this start's cores per GPU
    assert summary["epochs"] == summary["epochs_planned"] == 2  # trained to the end on the placement chosen
