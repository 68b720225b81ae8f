"""A machine gone without notice, or hung, is a preemption; a worker that crashed on a machine still up is a
failure (app/driver/machine_loss.py), on real Ray nodes of a cluster of this test's own, judged by Ray Train's
own failure policy with no failure allowed."""

from __future__ import annotations

import os
import signal

import pytest

from tests.faults import private_cluster

pytestmark = [pytest.mark.slow, pytest.mark.own_cluster]  # nodes that die


@pytest.fixture(scope="module")
def cluster():
    with private_cluster() as c:
        yield c


def _failure_of(call) -> Exception:
    import ray

    try:
        ray.get(call, timeout=120)
    except Exception as exc:  # what Ray Train's poll gets from a worker that is gone
        return exc
    raise AssertionError("the call returned")


def _decide(errors: dict[int, Exception], rank_nodes: dict[int, str], rank_actors: dict | None = None):
    """Ray Train's own policy with no failure allowed and unlimited preemptions, on the failure the callback
    raises (the controller hands it to the policy as is: lightray.ray_private) or, when it raises none, on
    Ray's own."""
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy
    from ray.train.v2.api.exceptions import WorkerGroupError

    from lightray.driver.machine_loss import reclassify

    policy = DefaultFailurePolicy(FailureConfig(max_failures=0, max_preemption_failures=-1))
    raised = reclassify(errors, rank_nodes, confirm_s=5, rank_actors=rank_actors, hung_s=5)
    failure = raised or WorkerGroupError(error_message="", worker_failures=errors)
    return policy.make_decision(failure).value, raised


def test_a_machine_gone_without_notice_is_a_preemption_and_a_crash_on_a_live_one_a_failure(cluster):
    import ray

    @ray.remote(num_cpus=0)
    class Worker:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def wait(self) -> None:
            import time

            time.sleep(300)

        def crash(self) -> None:
            os._exit(1)  # an OOM kill or a segfault, on a machine that stays up

    doomed = cluster.add_node(num_cpus=1, resources={"doomed": 1})
    live = cluster.add_node(num_cpus=1, resources={"live": 1})
    cluster.wait_for_nodes()
    on_doomed = Worker.options(resources={"doomed": 0.1}).remote()
    on_live = Worker.options(resources={"live": 0.1}).remote()
    assert ray.get(on_doomed.node.remote()) == doomed.node_id and ray.get(on_live.node.remote()) == live.node_id
    group = {0: doomed.node_id, 1: live.node_id}

    crashed = _failure_of(on_live.crash.remote())
    decision, raised = _decide({1: crashed, 0: RuntimeError("Connection closed by peer")}, group)
    assert (decision, raised) == ("RAISE", None), crashed  # charged to max_failures, as before
    assert _decide({0: RuntimeError("a bug in the training step")}, group) == ("RAISE", None)

    waiting = on_doomed.wait.remote()
    cluster.remove_node(doomed, allow_graceful=False)  # the machine goes away, no notice, no drain
    # The survivor's collective fails first, before Ray has seen the worker die (as a real run showed): the
    # machine is found gone all the same.
    survivor = RuntimeError("[gloo/transport/tcp/pair.cc:545] Read error: Connection reset by peer")
    decision, raised = _decide({1: survivor}, group)
    assert decision == "RETRY", raised
    lost = raised.worker_failures[0]
    assert lost.preempted and f"node {doomed.node_id}" in str(lost) and "went away without notice" in str(lost)
    assert raised.worker_failures[1] is survivor  # the survivor's error kept as it was
    gone = _failure_of(waiting)  # and once Ray has seen the worker die, not marked preempted by Ray itself
    assert not gone.preempted
    decision, raised = _decide({0: gone, 1: survivor}, group)
    assert decision == "RETRY" and str(gone) in str(raised.worker_failures[0]), raised


def test_a_peer_that_stops_answering_is_a_preemption_and_one_that_answers_leaves_the_failure_charged(cluster):
    """What the ranks of a group see when a peer hangs: their collective times out. The peer's process stopped
    (SIGSTOP, as a frozen machine) does not answer Ray; a peer alive in a deadlock of its own code would."""
    import ray

    @ray.remote(num_cpus=0)
    class Worker:
        def pid(self) -> int:
            return os.getpid()

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()  # the head: the other test's removed node may not be seen gone yet
    on_head = Worker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
    waiting, frozen = on_head.remote(), on_head.remote()
    pid = ray.get(frozen.pid.remote())
    group, actors = {0: node, 1: node}, {0: waiting, 1: frozen}
    timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv operation")
    assert _decide({0: timeout}, group, actors) == ("RAISE", None)  # the peer answers: a failure, as before
    os.kill(pid, signal.SIGSTOP)
    try:
        decision, raised = _decide({0: timeout}, group, actors)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert decision == "RETRY", raised
    hung = raised.worker_failures[1]
    assert hung.preempted and "stopped answering" in str(hung) and f"node {node}" in str(hung), hung
    assert raised.worker_failures[0] is timeout



def test_a_lone_worker_whose_health_check_timed_out_is_a_preemption_if_silent_and_a_failure_if_it_answers(cluster):
    """A group of one (an elastic run shrunk to one machine) has no peer whose collective would time out: a hang
    shows only as Ray Train's health-check timeout on the worker itself. Found by bench.soak: charged to
    scaling.max_failures, it ended a run with no failure allowed."""
    import ray
    from ray.train.v2._internal.exceptions import WorkerHealthCheckTimeoutError

    @ray.remote(num_cpus=0)
    class Worker:
        def pid(self) -> int:
            return os.getpid()

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    lone = Worker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
    pid = ray.get(lone.pid.remote())
    timed_out = WorkerHealthCheckTimeoutError("A worker health check has been hanging for 21.00 seconds.")
    assert _decide({0: timed_out}, {0: node}, {0: lone}) == ("RAISE", None)  # it answers: a slow poll, a failure
    os.kill(pid, signal.SIGSTOP)
    try:
        decision, raised = _decide({0: timed_out}, {0: node}, {0: lone})
    finally:
        os.kill(pid, signal.SIGCONT)
    assert decision == "RETRY", raised
    assert raised.worker_failures[0].preempted and "stopped answering" in str(raised.worker_failures[0])
