"""A worker group that cannot be placed: on a local cluster this run started, the command stops at once with
status 2 and one line; the check itself on the resources it compares."""

from __future__ import annotations

import io
import pathlib
import subprocess
import sys
import time

import pytest

from lightray.config import ConfigError
from lightray.driver import placement

ROOT = pathlib.Path(__file__).parents[1]


@pytest.mark.slow  # a Ray start in a subprocess
@pytest.mark.shares_cpu
def test_gpu_workers_on_a_local_cluster_without_gpus_exit_2_with_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the request fits")
    cache, local_cache = tmp_path / "cache", tmp_path / "local-cache"
    proc = subprocess.run([sys.executable, "app/run.py", "--gpu", "true", "--smoke-test", "--storage", str(tmp_path),
                           "--name", "gpu", "--scaling.ray_address=local", f"--data.cache_dir={cache}",
                           f"--data.local_cache_dir={local_cache}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [s for s in proc.stderr.splitlines() if s.startswith("lightray: error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert "2 workers x {CPU: 0.5, GPU: 1} cannot be placed" in errors[0]
    assert "no autoscaler" in errors[0] and "--gpu false" in errors[0]
    # It stops before the data and the trainer: nothing prepared (the run's own shard caches were never made),
    # no training started, no checkpoint, no summary.
    assert not cache.exists() and not local_cache.exists(), sorted(map(str, tmp_path.rglob("*")))
    assert not list(tmp_path.rglob("*.parquet"))
    assert not (tmp_path / "gpu" / "summary.json").exists()
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_local_fit_check_names_the_missing_resource():
    req = placement.worker_request(0.5, {}, use_gpu=True)
    assert req == {"CPU": 0.5, "GPU": 1.0}
    with pytest.raises(ConfigError, match=r"short by \{GPU: 2\}"):
        placement.check_local_fit(req, 2, {"CPU": 4.0, "memory": 1e9})
    with pytest.raises(placement.PlacementError, match=r"short by \{CPU: 2\}.*fewer --workers"):
        placement.check_local_fit(placement.worker_request(1.0, {}, False), 6, {"CPU": 4.0})
    placement.check_local_fit(placement.worker_request(0.5, {}, False), 2, {"CPU": 4.0})  # fits: no error
    placement.check_local_fit(req, 2, {"CPU": 4.0, "GPU": 2.0})


def test_wait_reporter_says_what_a_pending_group_waits_for(ray_local):
    from ray.util.placement_group import placement_group, remove_placement_group

    out = io.StringIO()
    pg = placement_group([{"CPU": 1.0, "GPU": 1.0}], strategy="PACK")  # this cluster has no GPU: pending
    rep = placement.WaitReporter({"CPU": 1.0, "GPU": 1.0}, "1", every_s=0.5, stream=out, can_grow=False).start()
    try:
        deadline = time.time() + 30
        while rep.lines == 0 and time.time() < deadline:
            time.sleep(0.2)
    finally:
        rep.stop()
        remove_placement_group(pg)
    text = out.getvalue()
    assert "waiting for the worker group: 1 workers x {CPU: 1, GPU: 1}" in text, text
    assert "in total" in text and "free" in text and "nothing will add nodes" in text


def test_auto_gpu_resolved_to_cpus_on_a_joined_cluster_warns_that_the_workers_stay_on_cpus():
    """A cluster that scales GPU machines from zero has none when the driver resolves ``scaling.use_gpu=auto``:
    the workers would ask for CPUs for the whole run, so the driver says so and names the flag."""
    from lightray.config import load_config
    from lightray.driver.runner import auto_gpu_warning

    auto, true = load_config("smoke", {"scaling.use_gpu": "auto"}), load_config("smoke", {"scaling.use_gpu": "true"})
    said = auto_gpu_warning(auto, use_gpu=False, started_here=False)
    assert said.startswith("lightray: warning: scaling.use_gpu=auto") and "--gpu true" in said
    # A cluster this run started has no autoscaler; GPUs found, or asked for, leave nothing to warn about.
    assert auto_gpu_warning(auto, use_gpu=False, started_here=True) is None
    assert auto_gpu_warning(auto, use_gpu=True, started_here=False) is None
    assert auto_gpu_warning(true, use_gpu=True, started_here=False) is None
