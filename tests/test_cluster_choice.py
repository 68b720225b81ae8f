"""Which Ray cluster a run with ``scaling.ray_address=auto`` (the default) is on: the one this host's ``ray start``
recorded (ray up's and KubeRay's heads), else one of its own. Never another run's private local cluster, which
ends when that run ends and took this run with it ("cluster lost"), as two `lightray train` on one machine did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from tests.faults import ROOT

# A driver that connects as `lightray train` does and says where it is; run A then waits for its stdin to close.
DRIVER = """
import json, sys
import ray
from lightray.config import load_config
from lightray.driver.runner import connect_ray
started = connect_ray(load_config("smoke", {{"scaling.ray_address": "{address}", "scaling.ray_num_cpus": "1"}}))
print(json.dumps({{"started": started, "gcs": ray.get_runtime_context().gcs_address}}), flush=True)
{then}
"""


def _driver(address: str, then: str = "ray.shutdown()", tmp: str | None = None, **kw) -> subprocess.Popen:
    """A driver with one auth mode for every cluster and client here: left unset, a local ray.init turns token auth
    on with the user's token file and a client may or may not find it. ``tmp``: its own Ray temp dir."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_AUTH_MODE": "disabled"}
    return subprocess.Popen([sys.executable, "-c", DRIVER.format(address=address, then=then)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, env=env | ({"RAY_TMPDIR": tmp} if tmp else {}), **kw)


def _where(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    assert line, f"driver exited {proc.wait(timeout=60)} before connecting"
    return json.loads(line)


@pytest.mark.slow
@pytest.mark.shares_cpu
def test_address_auto_starts_its_own_cluster_beside_another_runs_and_joins_one_ray_start_recorded():
    run_a = _driver("local", then="sys.stdin.read(); ray.shutdown()", stdin=subprocess.PIPE)
    try:
        a = _where(run_a)
        assert a["started"], a
        # Run B's "current cluster" file lies in a temp dir of its own: none there, as on a machine where no
        # `ray start` ran; no RAY_ADDRESS. Short: Ray's socket paths under it have a length cap.
        with tempfile.TemporaryDirectory(prefix="lr-") as tmp:
            run_b = _driver("auto", tmp=tmp)
            b = _where(run_b)
            assert run_b.wait(timeout=120) == 0
            assert b["started"] and b["gcs"] != a["gcs"], (a, b)  # the old code joined run A's cluster
            # Once `ray start` has recorded a cluster (here: A's address in B's file), auto joins it.
            os.makedirs(f"{tmp}/ray", exist_ok=True)
            with open(f"{tmp}/ray/ray_current_cluster", "w") as f:
                f.write(a["gcs"])
            run_c = _driver("auto", tmp=tmp)
            c = _where(run_c)
            assert run_c.wait(timeout=120) == 0
            assert not c["started"] and c["gcs"] == a["gcs"], (a, c)
    finally:
        run_a.stdin.close()
        run_a.wait(timeout=120)
