"""Spot watcher: real HTTP against an IMDSv2 imitation on 127.0.0.1, real Ray nodes (ray.cluster_utils), a
real drain through the GCS and a real Ray Train run that sees the preemption."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import threading
import time

import pytest

from lightray.config import ConfigError, ScalingConfig
from lightray.driver import placement
from lightray.driver.spot_watcher import (
    SpotWatcher,
    WatcherKeeper,
    drain_node_for_preemption,
    parse_notice,
    start_watchers,
    stop_watchers,
    watcher_statuses,
)
from tests.imds_server import ImdsServer

# ray.rpc.NodeDeathInfo.Reason: the node died after a drain with reason PREEMPTION.
PREEMPTED = 3


def wait_for(cond, timeout_s: float = 60.0, every_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"condition not met within {timeout_s} s")


def refused_url() -> str:
    """A 127.0.0.1 URL nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def imds():
    with ImdsServer() as server:
        yield server


# -- in-process: HTTP only ---------------------------------------------------------------------------------
def test_no_notice_while_endpoint_answers_404_and_token_is_reused(imds):
    watcher = SpotWatcher(imds.url, poll_s=0.1, drain=False)
    assert [watcher.poll_once() for _ in range(3)] == [None, None, None]
    st = watcher.status()
    assert (st["polls"], st["notices"], st["errors"], st["drained"]) == (3, 0, 0, False)
    assert imds.action_requests == 3
    assert imds.token_requests == 1  # IMDSv2 session token fetched once, not per poll
    assert imds.unauthorized == 0


def test_notice_is_returned_once_served_with_its_deadline(imds):
    watcher = SpotWatcher(imds.url, poll_s=0.1, drain=False)
    assert watcher.poll_once() is None
    served = imds.serve_notice("stop", in_s=90)
    notice = watcher.poll_once()
    assert notice == {"action": "stop", "time": served["time"], "deadline_ms": served["deadline_ms"]}
    st = watcher.status()
    assert st["notices"] == 1 and st["notice"] == notice and st["drained"] is False


def test_expired_token_is_renewed_after_401_without_an_error(imds):
    watcher = SpotWatcher(imds.url, poll_s=0.1, drain=False)
    watcher.poll_once()
    imds.expire_tokens()
    imds.serve_notice("terminate", in_s=60)
    assert watcher.poll_once()["action"] == "terminate"
    assert imds.token_requests == 2 and imds.unauthorized == 1
    assert watcher.status()["errors"] == 0


def test_refused_endpoint_is_retried_quietly_with_errors_counted():
    url = refused_url()
    watcher = SpotWatcher(url, poll_s=0.05, drain=False)
    assert watcher.poll_once() is None  # never raises
    watcher.start()
    try:
        wait_for(lambda: watcher.status()["polls"] >= 5, timeout_s=30)
        st = watcher.status()
        assert st["running"] is True  # the thread survives every failed poll
        assert st["errors"] == st["polls"] or st["errors"] == st["polls"] - 1  # one poll may be in flight
        assert url in st["last_error"] and "refused" in st["last_error"].lower()
    finally:
        watcher.stop()
    assert watcher.status()["running"] is False


def test_malformed_notice_counts_an_error_and_is_not_a_notice(imds):
    watcher = SpotWatcher(imds.url, poll_s=0.1, drain=False)
    imds.serve_notice(body="<html>oops</html>")
    assert watcher.poll_once() is None
    imds.serve_notice(body='{"action": "reboot", "time": "2026-11-30T12:00:00Z"}')
    assert watcher.poll_once() is None
    st = watcher.status()
    assert (st["errors"], st["notices"], st["drained"]) == (2, 0, False)
    assert "action 'reboot'" in st["last_error"] and "terminate, stop, hibernate" in st["last_error"]


def test_parse_notice_reads_utc_time_and_rejects_bad_fields_by_name():
    notice = parse_notice(b'{"action": "terminate", "time": "2026-11-30T12:00:00Z"}')
    assert notice["deadline_ms"] == 1796040000000
    assert parse_notice('{"action": "hibernate"}', now=1000.0)["deadline_ms"] == 1_120_000  # AWS's 2 minutes
    with pytest.raises(ValueError, match=r"time 'soon' is not an ISO 8601 time"):
        parse_notice('{"action": "stop", "time": "soon"}')
    with pytest.raises(ValueError, match=r"http://x/y: body '\[1\]' is not a JSON object"):
        parse_notice("[1]", source="http://x/y")


def test_bad_endpoint_or_mode_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"scaling\.spot_endpoint: bad value 'ftp://x'"):
        start_watchers(ScalingConfig(spot_endpoint="ftp://x"), "run")
    with pytest.raises(ConfigError, match=r"scaling\.spot_endpoint: bad value '169\.254\.169\.254'"):
        SpotWatcher("169.254.169.254", drain=False)


def test_config_accepts_spot_keys_and_rejects_bad_values():
    from lightray.config import load_config

    cfg = load_config("demo", {"scaling.spot_watcher": "on", "scaling.spot_poll_s": "0.5",
                               "scaling.spot_endpoint": "http://127.0.0.1:1"})
    assert (cfg.scaling.spot_watcher, cfg.scaling.spot_poll_s) == ("on", 0.5)
    with pytest.raises(ConfigError, match=r"scaling\.spot_watcher: bad value 'yes'"):
        load_config("demo", {"scaling.spot_watcher": "yes"})
    with pytest.raises(ConfigError, match=r"scaling\.spot_poll_s: bad value 0\.0"):
        load_config("demo", {"scaling.spot_poll_s": 0})


# -- real Ray nodes ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    """Our own head + one worker node (with a fake GPU and a resource that pins Train workers to it)."""
    import ray
    import ray._private.utils as ray_utils
    from ray.cluster_utils import Cluster

    # Ray Train's drain poll defaults to 5 s; the nodes' processes inherit this environment.
    saved_poll = os.environ.get("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S")
    os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = "0.5"
    # Cluster() points this host's "current cluster" file at itself; give other users of this host theirs back.
    address_file = pathlib.Path(ray_utils.get_ray_address_file(None))
    previous = address_file.read_text() if address_file.exists() else None
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    worker = c.add_node(num_cpus=2, num_gpus=1, resources={"spot_node": 1})
    try:
        ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
        c.wait_for_nodes()
        yield c, c.head_node.node_id, worker.node_id
    finally:
        ray.shutdown()
        c.shutdown()
        if saved_poll is None:
            os.environ.pop("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", None)
        else:
            os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = saved_poll
        if previous is not None:
            address_file.parent.mkdir(parents=True, exist_ok=True)
            address_file.write_text(previous)
        elif address_file.exists() and address_file.read_text() == c.address:
            address_file.unlink()


@pytest.mark.slow  # a two-node cluster of its own
@pytest.mark.shares_cpu
@pytest.mark.own_cluster
def test_start_watchers_puts_one_per_alive_node_and_is_idempotent(cluster, imds):
    _, head, worker = cluster
    cfg = ScalingConfig(spot_watcher="on", spot_endpoint=imds.url, spot_poll_s=0.2)
    handles = start_watchers(cfg, "idem")
    try:
        again = start_watchers(cfg, "idem")
        assert sorted(h._actor_id.hex() for h in again) == sorted(h._actor_id.hex() for h in handles)
        wait_for(lambda: all(s["polls"] >= 2 for s in watcher_statuses(handles)), timeout_s=60)
        statuses = watcher_statuses(handles)
        assert sorted(s["node_id"] for s in statuses) == sorted([head, worker])
        assert all(s["running"] and s["errors"] == 0 and not s["drained"] for s in statuses)
    finally:
        stop_watchers(handles)


@pytest.mark.slow  # a two-node cluster of its own
@pytest.mark.shares_cpu
@pytest.mark.own_cluster
def test_auto_mode_watches_gpu_nodes_only_unless_endpoint_is_set_and_off_watches_none(cluster, imds):
    _, head, worker = cluster
    handles = start_watchers(ScalingConfig(spot_watcher="auto", spot_poll_s=30.0), "auto-default")
    try:
        assert [s["node_id"] for s in watcher_statuses(handles)] == [worker]  # the head has no GPU
    finally:
        stop_watchers(handles)
    handles = start_watchers(ScalingConfig(spot_watcher="auto", spot_endpoint=imds.url, spot_poll_s=30.0), "auto-set")
    try:
        assert len(handles) == 2
    finally:
        stop_watchers(handles)
    assert start_watchers(ScalingConfig(spot_watcher="off", spot_endpoint=imds.url), "off") == []


@pytest.mark.slow  # a two-node cluster of its own
@pytest.mark.shares_cpu
@pytest.mark.own_cluster
def test_keeper_adds_a_watcher_when_a_node_joins_and_stop_ends_them_all(cluster, imds):
    c, head, worker = cluster
    cfg = ScalingConfig(spot_watcher="on", spot_endpoint=imds.url, spot_poll_s=0.5)
    keeper = WatcherKeeper(cfg, "keeper", every_s=0.5).start()
    new = None
    try:
        assert sorted(keeper.node_ids) == sorted([head, worker])  # the nodes alive at start, at once
        new = c.add_node(num_cpus=0)  # a replacement machine joining mid-run
        wait_for(lambda: new.node_id in keeper.node_ids, timeout_s=120)
        wait_for(lambda: any(s["node_id"] == new.node_id and s["polls"] > 0
                             for s in watcher_statuses(keeper.handles)), timeout_s=60)
    finally:
        handles = keeper.handles
        keeper.stop()
        if new is not None:
            c.remove_node(new)
    assert len(handles) == 3 and watcher_statuses(handles, timeout_s=5) == []  # all killed


@pytest.mark.slow  # a two-node cluster of its own
@pytest.mark.shares_cpu
@pytest.mark.own_cluster
def test_keeper_ends_the_watcher_of_a_draining_node_so_that_ray_retires_the_node(cluster, imds):
    """A watcher is an actor, and an actor keeps a drained node from going idle: Ray went on counting the node,
    and sized the worker group restarting after the notice's checkpoint onto it, until the notice's deadline.
    The node here holds nothing but its watcher; the drain comes from outside (the notice is its watcher's own
    business, tested below), with a deadline far beyond the test."""
    import ray

    c, head, worker = cluster
    spare = c.add_node(num_cpus=0, resources={"spare": 1})
    c.wait_for_nodes()
    cfg = ScalingConfig(spot_watcher="on", spot_endpoint=imds.url, spot_poll_s=0.5)
    keeper = WatcherKeeper(cfg, "retire", every_s=0.5).start()
    try:
        assert spare.node_id in keeper.node_ids
        accepted, why = drain_node_for_preemption(spare.node_id, int((time.time() + 600) * 1000),
                                                  "test: spot interruption notice")
        assert accepted, why
        dead = wait_for(lambda: next((n for n in ray.nodes() if n["NodeID"] == spare.node_id and not n["Alive"]),
                                     None), timeout_s=60, every_s=0.5)
        assert dead["DeathReason"] == PREEMPTED, dead
        # Its watcher's last status is kept for the run's summary; the other nodes keep their watchers.
        (last,) = [st for st in keeper.statuses() if st["node_id"] == spare.node_id]
        assert last["polls"] >= 1 and last["errors"] == 0, last
        assert sorted(keeper.node_ids) == sorted([head, worker])
    finally:
        keeper.stop()


@pytest.mark.slow  # a two-node cluster of its own
@pytest.mark.shares_cpu
@pytest.mark.own_cluster
def test_notice_drains_own_node_for_preemption_and_train_loop_sees_it(cluster, imds, tmp_path):
    """The real goal: a spot notice on the worker's node reaches ``ray.train.get_preemption_info()``.
    Runs last in this module: it leaves the worker node draining."""
    import ray
    import ray.train
    from ray.train import RunConfig
    from ray.train import ScalingConfig as TrainScalingConfig
    from ray.train.torch import TorchTrainer

    _, head, worker = cluster
    cfg = ScalingConfig(spot_watcher="on", spot_endpoint=imds.url, spot_poll_s=0.2)
    handles = start_watchers(cfg, "drain", node_ids=[worker])
    marker = tmp_path / "looping"

    def train_fn(config: dict) -> None:
        # What the loop saw goes to a file (same host): Train V2 keeps metrics only with checkpoints.
        pathlib.Path(config["marker"]).write_text("1")
        seen: dict = {"preempted_nodes": [], "deadline_ms": None, "node": ray.get_runtime_context().get_node_id()}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            info = ray.train.get_preemption_info()  # a collective: every rank calls it each iteration
            if info is not None:
                seen.update(preempted_nodes=list(info.preempted_node_ids), deadline_ms=info.deadline_ms)
                break
            time.sleep(0.2)
        pathlib.Path(config["seen"]).write_text(json.dumps(seen))

    served: dict = {}

    def serve_when_looping() -> None:
        wait_for(marker.exists, timeout_s=180, every_s=0.2)
        served.update(imds.serve_notice("terminate", in_s=100))

    feeder = threading.Thread(target=serve_when_looping, daemon=True)
    feeder.start()
    try:
        trainer = TorchTrainer(
            train_fn, train_loop_config={"marker": str(marker), "seen": str(tmp_path / "seen.json")},
            scaling_config=TrainScalingConfig(num_workers=1, use_gpu=False,
                                              resources_per_worker={"CPU": 1, "spot_node": 1}),
            run_config=RunConfig(name="spot-drain", storage_path=str(tmp_path / "storage")),
        )
        trainer.fit()
        feeder.join(timeout=5)
        seen = json.loads((tmp_path / "seen.json").read_text())
        assert seen["node"] == worker
        assert seen["preempted_nodes"] == [worker]
        assert seen["deadline_ms"] == served["deadline_ms"]  # the notice's own deadline
        # The GCS holds the drain: our node, the notice's deadline; the head is untouched.
        draining = ray._private.state.state.get_draining_nodes()
        assert draining == {worker: served["deadline_ms"]}
        (status,) = watcher_statuses(handles)
        assert status["drained"] is True and status["drain_result"] == "accepted"
        assert status["notice"]["action"] == "terminate" and status["notices"] >= 1
        # A node already draining gets no new watcher (a hard affinity there would wait forever).
        assert start_watchers(cfg, "after-drain", node_ids=[worker]) == []
        # A worker group waiting now is told what the draining node holds: the cluster counts it as free.
        waiting = placement.WaitReporter({"CPU": 1.0}, "1").describe(1)
        assert "{CPU: 3, GPU: 1, spot_node: 1} in total" in waiting, waiting
        assert "(of which {CPU: 2, GPU: 1, spot_node: 1} on 1 draining machine(s)" in waiting, waiting
    finally:
        stop_watchers(handles)
    # With the run and its watcher gone the drained node is idle, and Ray retires it: the GCS records the death
    # as the end of a PREEMPTION drain, with the watcher's message (another drain reason would not say so).
    dead = wait_for(lambda: next((n for n in ray.nodes() if n["NodeID"] == worker and not n["Alive"]), None),
                    timeout_s=120, every_s=0.5)
    assert dead["DeathReason"] == PREEMPTED, dead
    assert "spot interruption notice: terminate" in dead["DeathReasonMessage"]
