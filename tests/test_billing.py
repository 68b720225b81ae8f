"""The driver's node meter bills every attempt's machine time, outside the checkpoints, on a real local
Ray cluster; the summary prices those node-seconds."""

from __future__ import annotations

import time

import pytest

from lightray.config import load_config
from lightray.driver.billing import NodeMeter, read_billing
from lightray.report.summary import _priced
from tests.faults import wait_for


def _metered_attempt(run_dir: str) -> tuple[NodeMeter, dict, tuple[float, float]]:
    """One driver attempt's meter, stopped once billing.json shows it mid-run (flushed by the meter's own loop,
    as for a driver killed without warning): (meter, the bill stop() returned, the span that the attempt's
    billed interval must cover: from just after start() to just before stop())."""
    meter = NodeMeter(run_dir, "local", every_s=0.2, flush_s=0.5).start()
    started = time.time()
    mine = meter.attempt["id"]
    wait_for(lambda: any(a["id"] == mine and a["node_seconds"].get("local", 0) > 0
                         for a in read_billing(run_dir)["attempts"]), 60, "the meter's first flush", interval=0.05)
    stopping = time.time()
    return meter, meter.stop(), (started, stopping)


def _check_attempt(attempt: dict, meter: NodeMeter, span: tuple[float, float], nodes: int) -> None:
    """The attempt bills every one of ``nodes`` for its whole metered time: from start() to the last sample, which
    stop() takes; so at least the span the test saw between them and at most start to end as the meter recorded.
    Bounds from the meter's own clock readings: a loaded machine cannot break them, a wrong bill does."""
    assert attempt["id"] == meter.attempt["id"]
    assert attempt["start"] <= span[0] and span[1] <= attempt["end"], (attempt, span)  # stop() took a last sample
    billed = attempt["node_seconds"]["local"]
    assert nodes * (attempt["end"] - span[0]) - 1e-6 <= billed <= nodes * (attempt["end"] - attempt["start"]) + 1e-6, \
        (attempt, span, nodes)


def test_every_attempt_is_billed_and_the_bill_adds_up(tmp_path, ray_local):
    nodes = len([n for n in ray_local.nodes() if n["Alive"]])
    runs = [_metered_attempt(str(tmp_path)) for _ in range(2)]  # two driver attempts: a failed run, its --resume
    bill = runs[-1][1]
    assert len(bill["attempts"]) == 2 and bill == read_billing(str(tmp_path))
    # Each attempt's whole metered time on every live node, the first attempt's time included.
    for attempt, (meter, _, span) in zip(bill["attempts"], runs):
        _check_attempt(attempt, meter, span, nodes)
    assert sum(a["node_seconds"]["local"] for a in bill["attempts"]) == bill["node_seconds"]["local"]


def test_node_types_without_a_price_are_billed_at_the_configured_type():
    cfg = load_config("smoke", {"cost.node_type": "m6i.2xlarge"})
    priced = _priced(cfg, {"node_seconds": {"g5.48xlarge-spot": 10.0, "unknown-type": 5.0, "m6i.2xlarge": 1.0}})
    assert priced == {"g5.48xlarge-spot": 10.0, "m6i.2xlarge": 6.0}
    assert _priced(cfg, None) is None


@pytest.mark.slow  # a three-node cluster of its own
@pytest.mark.own_cluster
def test_two_runs_on_one_cluster_are_not_billed_for_each_other(tmp_path):
    """Two drivers (two Ray jobs) on one cluster of a head and two worker nodes, each holding one worker node
    through its placement group, as a run's worker group does: each run's meter bills the head (its driver)
    and its own worker node, never the other run's."""
    import subprocess
    import sys

    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from lightray.driver.billing import job_nodes
    from tests.faults import NodeCluster

    other = ("import sys, time, ray\n"
             "from ray.util.placement_group import placement_group\n"
             "ray.init(address=sys.argv[1], include_dashboard=False, log_to_driver=False)\n"
             "pg = placement_group([{'CPU': 0.5, 'trainer': 1}])\n"
             "ray.get(pg.ready())\n"
             "print(ray.get_runtime_context().get_job_id(), flush=True)\n"
             "sys.stdin.read()\n")
    with NodeCluster(workers=2, worker_cpus=1) as nodes:
        head = ray.get_runtime_context().get_node_id()
        proc = subprocess.Popen([sys.executable, "-c", other, nodes.address], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        try:
            other_job = proc.stdout.readline().strip()
            assert other_job, "the other run did not start"
            mine = placement_group([{"CPU": 0.5, "trainer": 1}])
            ray.get(mine.ready(), timeout=60)
            meter, bill, span = _metered_attempt(str(tmp_path))
            my_nodes, other_nodes = job_nodes(meter.job_id), job_nodes(other_job)
            remove_placement_group(mine)
        finally:
            proc.stdin.close()
            proc.wait(timeout=60)
        trainers = set(nodes.alive_trainer_nodes())
        assert meter.job_id != other_job
        assert my_nodes - {head} and other_nodes - {head} and (my_nodes | other_nodes) - {head} == trainers
        assert my_nodes & other_nodes <= {head}  # the driver's own node aside, nothing shared
        # Two nodes (the head and this run's worker node) for the whole metered time, not three, nor one.
        (attempt,) = bill["attempts"]
        _check_attempt(attempt, meter, span, 2)
