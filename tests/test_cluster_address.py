"""A run's private local cluster (``scaling.ray_address=local``) beside another cluster on the same host.

Ray Train's placement-group cleaner asks Ray's State API every second whether its run's controller lives, with no
address: so it asks the cluster this host's `ray start` recorded. When that was another cluster, the answer was
"no such actor", and the cleaner could remove the run's placement group, which kills its workers (traced here
2026-12-06 with a smoke run beside a `ray start` cluster). The run's processes must ask their own cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from tests.faults import ROOT

OTHER = """
import json, sys
import ray
ray.init(address="local", num_cpus=1, include_dashboard=True)
print(json.dumps({"gcs": ray.get_runtime_context().gcs_address}), flush=True)
sys.stdin.read()
ray.shutdown()
"""

RUN = """
import json
import ray
from lightray.config import load_config
from lightray.driver.runner import connect_ray

connect_ray(load_config("smoke", {"scaling.ray_address": "local", "scaling.ray_num_cpus": "2"}), dashboard=True)


@ray.remote(num_cpus=0)
class Alive:
    def actor_id(self):
        return ray.get_runtime_context().get_actor_id()


@ray.remote(num_cpus=0)
def state_of(actor_id):  # what Ray Train's cleaner does: ray.train.v2._internal.state.util.is_actor_alive
    from ray.util.state import get_actor

    found = get_actor(actor_id, timeout=30)
    return None if found is None else found.state


alive = Alive.remote()
print(json.dumps({"gcs": ray.get_runtime_context().gcs_address,
                  "state": ray.get(state_of.remote(ray.get(alive.actor_id.remote())))}), flush=True)
ray.shutdown()
"""


@pytest.mark.slow
@pytest.mark.shares_cpu
def test_a_private_clusters_processes_ask_the_state_api_of_their_own_cluster_not_the_one_ray_start_recorded():
    # One auth mode for both (unset, a local ray.init turns token auth on with the user's token file); a Ray temp
    # dir of the test's own, so that the "current cluster" file it writes is not the host's. Short: Ray's socket
    # paths under it have a length cap.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_AUTH_MODE": "disabled"}
    with tempfile.TemporaryDirectory(prefix="lr-") as tmp:
        env["RAY_TMPDIR"] = tmp
        other = subprocess.Popen([sys.executable, "-c", OTHER], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            line = other.stdout.readline()
            assert line, f"the other cluster's driver exited {other.wait(timeout=60)}"
            other_gcs = json.loads(line)["gcs"]
            # As `ray start` does for its cluster: the host's current cluster is the other one.
            os.makedirs(f"{tmp}/ray", exist_ok=True)
            with open(f"{tmp}/ray/ray_current_cluster", "w") as f:
                f.write(other_gcs)
            run = subprocess.run([sys.executable, "-c", RUN], cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=240)
            assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
            seen = json.loads(run.stdout.strip().splitlines()[-1])
        finally:
            other.stdin.close()
            other.wait(timeout=120)
    assert seen["gcs"] != other_gcs, seen
    # The old code: None (the other cluster has no such actor), on which the cleaner removes the placement group.
    assert seen["state"] == "ALIVE", seen
