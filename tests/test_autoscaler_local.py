"""The helpers that start and stop Ray's real autoscaler on this machine (tests/cluster/fake_cluster.py): a
process tree found and killed whole, as a spot loss and the cluster's stop do.

The autoscaler's end-to-end run (worker machines launched for a head with no CPU, token auth, a machine lost
mid-run, the run resumed and billed by the machines' price labels) is bench.soak's short form
(tests/test_soak.py), which also loses machines with notice and hung, kills the driver and takes S3 away.
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


def _load_module(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / "cluster" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


fake_cluster = _load_module("fake_cluster")


def test_process_tree_helpers_find_and_kill_a_whole_tree():
    proc = subprocess.Popen(["bash", "-c", "sleep 300 & sleep 300 & wait"])
    try:
        deadline = time.monotonic() + 10
        while True:
            tree = fake_cluster.with_descendants({proc.pid}, fake_cluster.process_table())
            if len(tree) >= 3 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(tree) >= 3  # bash and its two sleeps
        fake_cluster.kill_pids(tree)
        proc.wait(timeout=10)
        # A killed child can linger for a moment until init reaps it: poll instead of looking once.
        deadline = time.monotonic() + 10
        while (left := set(fake_cluster.process_table()) & (tree - {proc.pid})) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left
    finally:
        proc.kill()
