"""Shared fixtures: one local Ray cluster per test session, and a shared shard cache so that the demo
dataset is generated and prepared once, not once per test."""

from __future__ import annotations

import os
import pathlib

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")


@pytest.fixture(autouse=True)
def _short_train_controller_period(request, monkeypatch):
    """Ray Train's controller collects reports and worker-group state on a period (2 s by default), and every
    run of the default suite is short: at 0.5 s a smoke run ends about 6 s sooner (41-44 s -> 36-38 s,
    measured here on tests/test_native_size.py's demo run). Runs a test starts inherit it. The slow tests
    (fault injection, benches) keep Ray's default, the timing their faults were tuned on."""
    if request.node.get_closest_marker("slow") is None and "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S" not in os.environ:
        monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("shared-cache")


@pytest.fixture
def ray_local():
    """A local Ray cluster with more logical CPUs than cores (Train workers + Ray Data tasks).

    Started on first use and kept for later tests; modules that build their own multi-node cluster
    shut it down first, and the next user starts it again."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    return ray


@pytest.fixture(scope="session")
def smoke_overrides(shared_cache) -> dict:
    return {"data.cache_dir": str(shared_cache), "data.local_cache_dir": str(shared_cache / "local")}


@pytest.fixture(scope="module")
def ray_cluster():
    """A fresh local Ray cluster for one test module (prepare and source tests), shut down after it."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture
def s3_storage(monkeypatch):
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        import urllib.request

        import pyarrow.fs as pafs

        # moto keeps its buckets in this process, across server instances: start each test from an empty store
        urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST"))

        pafs.S3FileSystem(endpoint_override=f"{host}:{port}", scheme="http", region="us-east-1",
                          allow_bucket_creation=True).create_dir("lightray-runs")
        yield f"s3://lightray-runs/runs?endpoint_override={host}:{port}&scheme=http&region=us-east-1"
    finally:
        server.stop()
