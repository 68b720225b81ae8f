"""Ray's real autoscaler on this machine: worker "machines" launched on demand, one lost mid-run, the job
still succeeds from its checkpoint.

Uses Ray's fake multi-node provider with tests/cluster/fake-cluster.yaml (the node types of cluster.yaml)
and token auth on. A spot loss is simulated the way it looks to Ray: the node's raylet and all of its
child processes are killed at once (SIGKILL, no drain). The clusters here run on their own ports and temp
dir and are stopped by killing their own processes by pid, never with `ray stop` (other Ray clusters may
be running on this host).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys
import tempfile
import time
import urllib.error
from collections.abc import Callable
from typing import Any

import pytest

from tests.faults import records

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
EXCLUDES = [".git", "**/__pycache__", ".pytest_cache", ".ruff_cache", "runs", "lightray_runs", "data_cache",
            "*.egg-info", ".gl"]


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


def committed_checkpoint(run_dir: pathlib.Path) -> bool:
    """Whether Ray Train's controller has registered a checkpoint of the run (not just a folder written:
    a checkpoint counts once the controller has every rank's report, and only then is it resumed from)."""
    try:
        snap = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(snap.get("latest_checkpoint_result"))


def _job_status(fc, job_id: str) -> str:
    return fc.get(f"/api/jobs/{job_id}")["status"]


def _submit(fc, job_id: str, entrypoint: list[str]) -> None:
    # The documented command: working dir = the repository, excludes for runs and caches.
    cmd = ["ray", "job", "submit", "--no-wait", "--submission-id", job_id, "--working-dir", ".",
           "--runtime-env-json", json.dumps({"excludes": EXCLUDES}), "--", *entrypoint]
    res = subprocess.run(cmd, cwd=REPO, env=fc.env(RAY_ADDRESS=fc.dashboard_url), capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]


def _logs(fc, job_id: str) -> str:
    res = subprocess.run(["ray", "job", "logs", job_id], env=fc.env(RAY_ADDRESS=fc.dashboard_url),
                         capture_output=True, text=True, timeout=120)
    return (res.stdout + res.stderr)[-6000:]


def _run_with_spot_loss(fc, job_id: str, entrypoint: list[str], ready: Callable[[], bool],
                        victim: Callable[[list[dict[str, Any]]], dict[str, Any]], timeout_s: float = 480) -> dict:
    """Submit, kill one worker machine once ``ready()``, wait for the job to end; what was seen."""
    seen: dict[str, Any] = {"max_workers": 0, "killed": None, "status": None}
    _submit(fc, job_id, entrypoint)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = _job_status(fc, job_id)
        workers = fc.alive_workers()
        seen["max_workers"] = max(seen["max_workers"], len(workers))
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            seen["status"] = status
            break
        if seen["killed"] is None and ready():
            node = victim(workers)
            seen["killed_processes"] = len(fc.kill_node(node))
            seen["killed"] = node["nodeId"]
        time.sleep(1.0)
    seen["logs"] = _logs(fc, job_id)
    return seen


@pytest.mark.timing_bound
@pytest.mark.slow
def test_autoscaler_launches_workers_and_a_smoke_run_survives_a_spot_loss_billed_by_node_label():
    """The documented path end to end: `ray job submit` of `app/run.py --smoke-test` to a cluster whose head has
    no CPU, the autoscaler launching a worker machine per training worker, one of them lost (SIGKILL, no drain)
    after a checkpoint, and the run finished from that checkpoint, its bill kept by the machines' labels."""
    storage = pathlib.Path(tempfile.mkdtemp(prefix="lrfcst", dir="/tmp"))
    run_dir = storage / "smoke"

    def ready() -> bool:
        # A checkpoint committed: a loss now must resume, not start over.
        return committed_checkpoint(run_dir)

    def any_worker(workers: list[dict]) -> dict:
        return workers[-1]  # 1.5 CPUs a training worker on 2-CPU machines: every worker machine holds one

    entry = ["python", "app/run.py", "--smoke-test", "--storage", str(storage), "--name", "smoke",
             # One training worker per fake machine (2 logical CPUs each), half a CPU left for Ray Data.
             "--scaling.cpus_per_worker=1.5",
             f"--data.local_cache_dir={storage}/local-cache"]
    try:
        with fake_cluster.FakeCluster() as fc:
            # The head advertises no CPU and no GPU: without the autoscaler nothing of the job could run.
            assert fc.alive_workers() == []
            # Token auth is on: the job API refuses a caller without the token.
            with pytest.raises(urllib.error.HTTPError) as refused:
                fc.get("/api/jobs/", token=False)
            assert refused.value.code in (401, 403)
            seen = _run_with_spot_loss(fc, "smoke", entry, ready, any_worker)
            temp_dir = fc.temp_dir
        assert seen["status"] == "SUCCEEDED", seen["logs"]
        assert seen["killed"] is not None, "the smoke run ended before a worker machine could be killed"
        assert seen["max_workers"] >= 2  # launched by the autoscaler, one per training worker
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["restarts"] >= 1
        assert summary["epochs"] == summary["epochs_planned"]
        starts = [r for r in records(run_dir) if r.get("event") in ("start", "restart")]
        assert starts[0]["samples_seen"] == 0
        # The worker group came back from a checkpoint, not from step 0.
        assert all(r["samples_seen"] > 0 for r in starts[1:]), starts
        # Ray Data's CPU share was sized at each worker-group start from the machines then up, not once on the
        # CPU-less head (where the old driver fixed it at the 0.5-CPU floor for the whole run).
        shares = [r for r in records(run_dir) if r.get("unit") == "data_share"]
        assert len(shares) >= len(starts) >= 2, shares
        assert all(r["train_cpus"] == 2 * 1.5 and r["data_cpus"] == max(0.5, r["cluster_cpus"] - 3.0)
                   for r in shares), shares
        assert shares[0]["cluster_cpus"] >= 4 and shares[0]["data_cpus"] >= 1.0, shares
        # The bill went through the loss, the worker machines priced by their labels. The head, which holds the
        # driver and carries no label, is billed at the run's default key ("local").
        cost = summary["cost"]
        assert cost["node_hours"] > 0 and cost["usd"] > 0
        assert "g5.48xlarge-spot" in cost["prices"], cost
        assert set(cost["prices"]) <= {"g5.48xlarge-spot", "g5.48xlarge", "local"}, cost
        # Stopped by pid: nothing of this cluster is left running.
        assert not [cmd for _, cmd in fake_cluster.process_table().values() if temp_dir in cmd]
    finally:
        import shutil

        shutil.rmtree(storage, ignore_errors=True)
