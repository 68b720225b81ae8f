"""Fault tolerance across nodes: real Ray nodes on this machine (ray.cluster_utils), a
real driver process (`python app/run.py --smoke-test` joined to that cluster), one Train worker per worker node
(`--scaling.worker_resources={trainer: 1}`), real gloo DDP. The audit is what the final model carries: per epoch,
the sample ids of the steps that survived every rollback equal the epoch plan's exactly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import pytest

from lightray.driver.spot_watcher import drain_node_for_preemption
from tests.faults import (
    NodeCluster,
    carried_samples,
    checkpoints,
    cluster_driver,
    events,
    finish,
    kill_group,
    last_samples,
    planned_samples,
    run_schedule,
    same_multiset,
    steps_for,
    train_records,
    train_worker_pids,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.own_cluster]
EPOCH0 = 8 * 64  # samples in each of the first two epochs (512 // 64 steps of 64)


@pytest.fixture(scope="module")
def cluster():
    with NodeCluster(workers=2) as c:
        yield c


@pytest.fixture
def nodes(cluster):
    """The module's cluster with two live trainer nodes: each test leaves two behind (a lost node is replaced)."""
    assert len(cluster.alive_trainer_nodes()) == 2, cluster.alive_trainer_nodes()
    return cluster


def _summary(run):
    return json.loads((run / "summary.json").read_text())


def _stepped_past_a_checkpoint_at_world_size_1(run) -> bool:
    """A step at world size 1 past a checkpoint written at world size 1: that checkpoint is whole (a report
    returns once its checkpoint is stored), where one whose meta file has just appeared may not be yet."""
    ones = []
    for c in checkpoints(run):
        with contextlib.suppress(ValueError):  # a meta file being written reads as not there yet
            meta = json.loads((c / "meta_rank0.json").read_text())
            if meta["world_size"] == 1:
                ones.append(meta["samples_seen"])
    return bool(ones) and any(r["world_size"] == 1 and r["samples_seen"] > min(ones) for r in train_records(run))


def _checkpoint_samples(run) -> set[int]:
    return {int(p.name.split("_")[1]) for p in checkpoints(run)}


def test_a_machine_lost_without_notice_runs_nothing_more_once_it_is_removed(nodes, tmp_path):
    """The fault tests' machine loss (NodeCluster.remove_worker) leaves nothing of the node running: a worker
    process that outlived its raylet could step and write a checkpoint after the loss (a CI run failed so). An
    actor on a trainer node counts into a file every few milliseconds; from the removal until Ray has marked the
    node dead (seconds later), the count does not move."""
    import ray

    @ray.remote(num_cpus=0, resources={"trainer": 1})
    class Counter:
        def start(self, path: str) -> str:
            import threading

            def count():
                n = 0
                with open(path, "r+b", buffering=0) as f:
                    while True:
                        n += 1
                        os.pwrite(f.fileno(), n.to_bytes(8, "little"), 0)
                        time.sleep(0.005)  # the worker's pace, not a wait of the test

            threading.Thread(target=count, daemon=True).start()
            return ray.get_runtime_context().get_node_id()

    counter = tmp_path / "counter"
    counter.write_bytes(bytes(8))
    node_id = ray.get(Counter.remote().start.remote(str(counter)), timeout=120)
    wait_for(lambda: counter.read_bytes() != bytes(8), 60, "the actor counting")
    (node,) = [n for n in nodes.nodes if n.node_id == node_id]
    nodes.remove_worker(node)
    try:
        at_removal = counter.read_bytes()
        # The next test starts on two live trainer nodes, so the lost one must be marked dead first (about 6 s):
        # long after a worker that outlived its raylet would have counted on.
        wait_for(lambda: node_id not in nodes.alive_trainer_nodes(), 120, "the lost node marked dead")
        after = counter.read_bytes()
        assert after == at_removal, (f"the removed machine's actor counted on after the removal: "
                                     f"{int.from_bytes(at_removal, 'little')} -> {int.from_bytes(after, 'little')}")
    finally:
        nodes.add_worker()


def test_a_notice_and_a_lost_node_in_one_run_lose_no_noticed_work_and_carry_each_planned_sample_once(
        nodes, tmp_path, shared_cache):
    """A spot notice (the node drained for preemption) and later a node gone without notice, in one run of fixed
    size with no failure allowed: both are charged to Ray's preemption budget (app/driver/machine_loss.py for the
    loss without notice); the notice's checkpoint loses nothing; the loss rolls back to a checkpoint written
    before it; in the end the model carries every planned sample exactly once. 6 epochs (80 steps): room for
    both faults."""
    epochs = 6
    # Every checkpoint kept, so that the one each restart used can be read back afterwards. No failure allowed:
    # a machine going away, with notice or without, is a preemption (Ray's unlimited budget), never a failure.
    proc = cluster_driver(nodes, tmp_path, "faults", "--checkpoint.keep=100", "--scaling.max_failures=0",
                          cache=shared_cache, epochs=epochs)
    run = tmp_path / "faults"
    try:
        wait_for(lambda: checkpoints(run), 300, "the first checkpoint", proc)
        doomed = nodes.nodes[0]
        deadline_ms = int((time.time() + 120) * 1000)
        accepted, why = drain_node_for_preemption(doomed.node_id, deadline_ms, "test: spot interruption notice")
        assert accepted, why
        nodes.add_worker()  # the replacement, launched when the notice came
        wait_for(lambda: events(run, "restart"), 300, "the restart off the draining node", proc)
        nodes.remove_worker(doomed)  # the machine goes away once Ray Train has left it
        resumed = events(run, "restart")[0]["samples_seen"]
        # A checkpoint after the restart and some steps past it, so that the loss rolls work back.
        wait_for(lambda: max(_checkpoint_samples(run)) > resumed and last_samples(run) > max(_checkpoint_samples(run)),
                 300, "a checkpoint after the restart and a step past it", proc)
        before_loss = len(events(run, "restart"))  # the notice's restart(s)
        nodes.remove_worker()  # a Train worker's machine gone, no notice
        # Where the run had got to: workers write checkpoints straight to storage, while the driver writes their
        # reports to metrics.jsonl a moment later, so the newest checkpoint can be ahead of the last line.
        lost_at = max(last_samples(run), max(_checkpoint_samples(run)))
        nodes.add_worker()  # the autoscaler's replacement
        out = finish(proc, timeout=300)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    summary = _summary(run)
    assert summary["status"] == "finished", out[-3000:]
    restarts = events(run, "restart")
    assert len(restarts) > before_loss >= 1 and summary["restarts"] >= 2
    # The notice: its own checkpoint, resumed from with nothing lost.
    (notice,) = events(run, "preemption_checkpoint")
    saved = notice["samples_seen"]
    assert restarts[0]["samples_seen"] == saved and restarts[0]["checkpoint"].endswith(f"checkpoint_{saved:012d}")
    # The checkpoint resumed from is the one written for the notice, not an earlier interval or epoch one.
    meta = json.loads((run / f"checkpoint_{saved:012d}" / "meta_rank0.json").read_text())
    assert (meta["reason"], meta["samples_seen"], meta["world_size"]) == ("preemption", saved, 2)
    assert summary["preemption_checkpoints"] == 1
    first, second = summary["lost_work"][0], summary["lost_work"][before_loss]
    assert first["resumed_at"] == saved and first["lost_samples"] == 0, summary["lost_work"]
    # The loss: resumed from a checkpoint written before it (checked by name: they are all kept).
    lost = restarts[before_loss]
    assert lost["checkpoint"].endswith(f"checkpoint_{lost['samples_seen']:012d}")
    assert saved < lost["samples_seen"] <= lost_at
    assert second["resumed_at"] == lost["samples_seen"]
    assert summary["samples_seen"] == 2 * EPOCH0 + (epochs - 2) * 16 * 32
    carried, planned = carried_samples(run), planned_samples(run)
    assert sorted(carried) == list(range(epochs))
    assert same_multiset(carried, planned) == {}


def test_elastic_run_shrinks_to_one_worker_and_grows_back_on_the_recipes_lr_and_global_batch(
        nodes, tmp_path, shared_cache):
    # Right after the loss Ray Train still asks for 2 workers and waits for that placement group until its
    # worker-group start timeout before it falls back to 1: scaling.elastic_start_timeout_s (20 s) instead of Ray's
    # 60, set by the run itself (a timed-out start is retried, not charged as a failure).
    proc = cluster_driver(nodes, tmp_path, "elastic", "--workers", "1:2", "--scaling.resize_check_s=2",
                          cache=shared_cache, epochs=8)
    run = tmp_path / "elastic"
    paused = []
    try:
        wait_for(lambda: checkpoints(run), 300, "the first checkpoint", proc)
        assert {r["world_size"] for r in train_records(run)} == {2}
        nodes.remove_worker()
        wait_for(lambda: _stepped_past_a_checkpoint_at_world_size_1(run), 300,
                 "a step past a checkpoint at world size 1", proc)
        # The lone worker is paused (SIGSTOP) past its first checkpoint, until the grow-back replaces it: Ray Train
        # sees a new node only through the autoscaling coordinator, whose view of the cluster refreshes every 20 s,
        # and unpaused the world-size-1 stretch (about 17 s here) can end the run before then. A paused worker
        # misses health checks, which Ray Train forgives for 10 minutes; the resize kills it as it kills any old
        # worker, and the new group resumes from the world-size-1 checkpoint: the resize from 1 to 2.
        paused = train_worker_pids(nodes)
        assert len(paused) == 1, paused
        os.kill(paused[0], signal.SIGSTOP)
        nodes.add_worker()
        out = finish(proc, timeout=480)
    finally:
        for pid in paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            kill_group(proc)
    summary = _summary(run)
    assert summary["status"] == "finished", out[-3000:]
    assert [(e["from"], e["to"]) for e in events(run, "resize")] == [(2, 1), (1, 2)]
    assert summary["resizes"] == 2
    train = train_records(run)
    sizes = [r["world_size"] for r in train]
    assert sizes[0] == 2 and 1 in sizes and 2 in sizes[sizes.index(1):] and sizes[-1] == 2
    sched = run_schedule(run)
    for r in train:
        # worker.py sets the LR from samples_seen *before* the step, then adds the phase batch and reports: the
        # value reported with samples_seen S is the LR of the step that started at S - batch.
        before = r["samples_seen"] - r["batch_size"]
        assert r["batch_size"] == sched.phase_at(before).batch_size, r
        assert r["lr"] == sched.lr_at(before), r
        # Steps taken = the recipe's steps to reach S: every step consumed one recipe global batch, at any world size.
        assert r["step"] == steps_for(sched, r["samples_seen"]), r
    assert summary["samples_seen"] == sched.total_samples == 2 * EPOCH0 + 6 * 16 * 32
    assert same_multiset(carried_samples(run), planned_samples(run)) == {}
