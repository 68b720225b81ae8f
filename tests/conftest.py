"""Shared fixtures. One local Ray cluster per test session, one shard cache, one finished run and one wheel,
each made by the first test that asks and read by the rest.

``LIGHTRAY_TEST_SHARED`` (set by .ci/run for its whole run) names a folder that outlives one pytest session, so
that the default and the slow suites of one CI run share the shard cache, the finished run, the wheel and the
inductor cache; without it, everything lives in the session's temp folder."""

from __future__ import annotations

import os
import pathlib

import pytest

# Each test's busy CPU-seconds, and a table of the heaviest at the end of the run (tests/cpu_time.py).
from tests.cpu_time import (  # noqa: F401
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_runtest_protocol,
    pytest_terminal_summary,
)

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
# How long a starting Ray node waits for its raylet to register with the GCS: one long poll of that many seconds
# (Ray's system config raylet_start_wait_time_s, 30 by default; Ray's own error names the setting). Beside the
# heavy tests in CI, a test's node missed 30 s three times on 2026-12-06 ("The current node timed out during
# startup"). Every node the tests start, in this process or in the drivers and benches they run, inherits it.
RAY_START_WAIT_S = 120
os.environ.setdefault("RAY_raylet_start_wait_time_s", str(RAY_START_WAIT_S))
from tests import machine_gate  # noqa: E402
from tests.s3_server import S3_ENV  # noqa: E402

# Dummy credentials for the local S3 server (moto), set before any cluster starts: Ray's worker processes take
# the environment the cluster started with, and the session cluster serves the S3 tests' Ray Data reads too.
for _k, _v in S3_ENV.items():
    os.environ.setdefault(_k, _v)

TIMEOUT_S = 300  # as pyproject.toml's [tool.pytest.ini_options] timeout
SESSION_CPUS = 6  # logical CPUs of the session cluster: Train workers, Ray Data tasks and two search trials


def pytest_configure(config):
    machine_gate.register(config)


def pytest_collection_modifyitems(config, items):
    # Tests marked timing_bound go last: their waits and limits assume the machine to themselves, and in CI the
    # shares_cpu tests run beside this process (.ci/run) until tests/machine_gate.py holds them off; by then most
    # of them have run. Within each half, tests marked own_cluster replace or end this process's Ray cluster:
    # they run after every test that shares the session cluster, so that it starts at most twice. A stable sort:
    # file order is kept within each group.
    items.sort(key=lambda item: (item.get_closest_marker("timing_bound") is not None,
                                 item.get_closest_marker("own_cluster") is not None))
    # At most TIMEOUT_S a test in CI (the `bench` runs, by hand only, may take longer): a hung run fails in
    # minutes and names its test, instead of eating CI's limit.
    for item in items:
        mark = item.get_closest_marker("timeout")
        if mark and mark.args and mark.args[0] > TIMEOUT_S and item.get_closest_marker("bench") is None:
            raise pytest.UsageError(f"{item.nodeid}: timeout({mark.args[0]}) is over the {TIMEOUT_S} s a test may "
                                    "take; make the test shorter")


def shared_dir(tmp_path_factory) -> pathlib.Path:
    """The folder shared by every test of this CI run (LIGHTRAY_TEST_SHARED) or else of this session."""
    given = os.environ.get("LIGHTRAY_TEST_SHARED")
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each pytest-xdist process has its own temp folder under the run's
        base = base.parent
    path = pathlib.Path(given) if given else base / "shared"
    path.mkdir(parents=True, exist_ok=True)
    return path


def start_session_ray():
    """This process's Ray: the session cluster, started on first use (and again after a test that needed a
    cluster of its own shut it down)."""
    import ray

    from lightray.ray_private import own_address_for_a_local_cluster

    if not ray.is_initialized():
        # Its processes ask Ray's State API their own cluster, not one a `ray start` on this host recorded.
        with own_address_for_a_local_cluster():
            ray.init(address="local", num_cpus=SESSION_CPUS, include_dashboard=False, log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
    return ray


@pytest.fixture(autouse=True)
def _no_stale_cluster_address():
    """A test cluster killed without ``ray stop`` (or one from an earlier CI run) leaves this host's "current
    cluster" file naming a dead address; Ray's State API then waits out its retries in every Ray Train run's
    placement-group cleaner, about 12 s at each run's end (lightray.ray_private). Checked around every test, as
    the drivers lightray starts check it themselves."""
    from lightray.ray_private import drop_stale_cluster_address

    drop_stale_cluster_address()
    yield
    drop_stale_cluster_address()


@pytest.fixture(autouse=True)
def _logger_levels_restored():
    """The CLI, run in process, quietens Ray's and lightray's loggers as it would for a user; a later test in the
    same process must not find its INFO records filtered out before its handler (a CI run failed so, 2026-12-05)."""
    import logging

    manager = logging.root.manager
    before = {name: lg.level for name, lg in manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    root_level = logging.root.level
    yield
    for name, lg in list(manager.loggerDict.items()):
        if isinstance(lg, logging.Logger):
            lg.setLevel(before.get(name, logging.NOTSET))
    logging.root.setLevel(root_level)


@pytest.fixture(autouse=True)
def _short_train_controller_period(monkeypatch):
    """Ray Train's controller collects reports and worker-group state on a period (2 s by default), and every
    run of the suite is short: at 0.5 s a smoke run ends about 6 s sooner (41-44 s -> 36-38 s, measured here
    on tests/test_native_size.py's demo run), and a failed worker group is seen sooner. Runs a test starts
    inherit it."""
    if "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S" not in os.environ:
        monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


@pytest.fixture(scope="session", autouse=True)
def _shared_inductor_cache(tmp_path_factory):
    """torch.compile's caches kept across the tests (and the suites) of one run: compiled once, loaded after."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(shared_dir(tmp_path_factory) / "inductor"))


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> pathlib.Path:
    path = shared_dir(tmp_path_factory) / "shard-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture
def ray_local():
    """The session's local Ray cluster, with more logical CPUs than cores (Train workers + Ray Data tasks)."""
    return start_session_ray()


@pytest.fixture(scope="session")
def smoke_overrides(shared_cache) -> dict:
    return {"data.cache_dir": str(shared_cache), "data.local_cache_dir": str(shared_cache / "local")}


@pytest.fixture
def ray_cluster():
    """The session's local Ray cluster (the name the prepare and source tests use)."""
    return start_session_ray()


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, shared_cache) -> pathlib.Path:
    """One finished smoke run, read by every test that only reads one (see tests/finished_run.py)."""
    from tests.finished_run import finished_run as make
    from tests.once import one_maker

    shared = shared_dir(tmp_path_factory)
    with one_maker(shared / "finished-run"):
        return make(shared, shared_cache)


@pytest.fixture(scope="session")
def lightray_wheel(tmp_path_factory) -> pathlib.Path:
    """The wheel, built once per run from exactly the files the Dockerfile copies (see tests/wheel.py)."""
    from tests.once import one_maker
    from tests.wheel import build_wheel

    folder = shared_dir(tmp_path_factory) / "wheel"
    with one_maker(folder):
        return build_wheel(folder)


@pytest.fixture
def s3_storage(monkeypatch):
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    from tests.s3_server import LocalS3Server

    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    server = LocalS3Server()  # moto, with its conditional writes atomic as S3's are (tests/s3_server.py)
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
