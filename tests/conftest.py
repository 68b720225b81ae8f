"""Shared fixtures: one local Ray cluster per test session, and a shared shard cache so that the demo
dataset is generated and prepared once, not once per test."""

from __future__ import annotations

import os
import pathlib

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")


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
