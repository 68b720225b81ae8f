"""The driver's node meter bills every attempt's machine time, outside the checkpoints, on a real local
Ray cluster; the summary prices those node-seconds."""

from __future__ import annotations

import time

from lightray.config import load_config
from lightray.driver.billing import NodeMeter, read_billing
from lightray.report.summary import _priced


def test_every_attempt_is_billed_and_the_bill_adds_up(tmp_path, ray_local):
    nodes = len([n for n in ray_local.nodes() if n["Alive"]])
    walls = []
    for _ in range(2):  # two driver attempts on the same run, as a failed run and its --resume
        t0 = time.time()
        meter = NodeMeter(str(tmp_path), "local", every_s=0.2, flush_s=0.5).start()
        time.sleep(1.5)
        bill = meter.stop()
        walls.append(time.time() - t0)
    assert len(bill["attempts"]) == 2 and bill == read_billing(str(tmp_path))
    total = bill["node_seconds"]["local"]
    # Each attempt's whole wall time on every live node, the first attempt's time included.
    assert 0.8 * nodes * sum(walls) <= total <= 1.05 * nodes * sum(walls), (total, walls, nodes)
    assert sum(a["node_seconds"]["local"] for a in bill["attempts"]) == total


def test_node_types_without_a_price_are_billed_at_the_configured_type():
    cfg = load_config("smoke", {"cost.node_type": "m6i.2xlarge"})
    priced = _priced(cfg, {"node_seconds": {"g5.48xlarge-spot": 10.0, "unknown-type": 5.0, "m6i.2xlarge": 1.0}})
    assert priced == {"g5.48xlarge-spot": 10.0, "m6i.2xlarge": 6.0}
    assert _priced(cfg, None) is None


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
            t0 = time.time()
            meter = NodeMeter(str(tmp_path), "local", every_s=0.2, flush_s=0.5).start()
            time.sleep(1.5)
            bill = meter.stop()
            wall = time.time() - t0
            my_nodes, other_nodes = job_nodes(meter.job_id), job_nodes(other_job)
            remove_placement_group(mine)
        finally:
            proc.stdin.close()
            proc.wait(timeout=60)
        trainers = set(nodes.alive_trainer_nodes())
        assert meter.job_id != other_job
        assert my_nodes - {head} and other_nodes - {head} and (my_nodes | other_nodes) - {head} == trainers
        assert my_nodes & other_nodes <= {head}  # the driver's own node aside, nothing shared
        # Two nodes (the head and this run's worker node) for the whole wall time, not three.
        assert 0.8 * 2 * wall <= bill["node_seconds"]["local"] <= 1.05 * 2 * wall, (bill, wall)
