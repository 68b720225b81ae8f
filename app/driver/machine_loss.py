"""A worker group that failed because a machine went away without notice is a preemption, not a failure.

Ray Train charges a failed worker group to ``max_preemption_failures`` (unlimited in lightray) only when a
worker's error is marked ``preempted``, which Ray sets for a node drained for preemption. A machine that
vanishes without a drain (a spot reclaim the watcher missed, a host failure) shows up first either as the
dead worker's actor being unreachable or as the surviving ranks' collective failing ("Connection reset by
peer"), neither marked, and was charged to ``scaling.max_failures``: a long spot run died after about ten.

``MachineLossCallback`` runs in Ray Train's controller. It notes the node of every worker at each worker-group
start; when a poll finds errors and none is already a preemption, it asks whether any of the group's nodes is
gone (its raylet unreachable or the GCS marking it dead, waiting up to ``confirm_s`` when the errors look like a
lost peer). When one is, it raises the group's failure again with the workers of the gone nodes failing as
``MachineLostError`` (a ``RayActorError`` marked ``preempted``) and the others' errors as they were; Ray Train's
failure policy takes it as is and charges the preemption budget. A worker that crashed on a machine still up
(an OOM kill, a segfault) and every Python error stay failures.

A hung peer is a machine gone too: when no node is gone, the ranks that reported no error are asked Ray's
``__ray_ready__`` (served by the worker process itself, beside the training thread). A rank that does not answer
within ``hung_s`` while its peers failed is a frozen machine or process (a stopped VM, a wedged host), not a bug:
a deadlock in training code leaves the process answering, and its peers' collective timeout stays a failure. The
silent ranks fail as ``MachineLostError`` too. The Ray internals this needs (a worker-group callback, the workers'
node ids and actors, the controller handing a raised failure to its policy) are checked at start-up by
``lightray.ray_private.check``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray.exceptions import RayActorError
from ray.train.v2.api.exceptions import WorkerGroupError

from lightray import ray_private
from lightray.driver.cluster_loss import gcs_reachable

log = logging.getLogger("lightray")
CONFIRM_S = 10.0  # how long a lost peer's machine may take to be seen gone (its raylet refusing, or silent)
# How long a rank that reported no error may take to answer __ray_ready__ before it counts as hung: a live worker
# answers in milliseconds, and seconds on a loaded machine.
HUNG_S = 10.0
# What a surviving rank or the controller sees when a peer's process went away (gloo, NCCL, Ray's RPC).
PEER_LOST = ("connection reset", "connection closed", "socket closed", "broken pipe", "unavailable",
             "communicator was aborted", "died")


class MachineLostError(RayActorError):
    """A worker's machine went away without notice; marked ``preempted`` so that Ray Train charges it to the
    preemption budget."""

    def __init__(self, message: str):
        super().__init__(error_msg=message, preempted=True)
        self.message = message

    def __reduce__(self):
        return (type(self), (self.message,))


def _preempted(error: Exception) -> bool:
    inner = getattr(error, "health_check_failure", error)  # Ray wraps a failed health check around the cause
    return isinstance(inner, RayActorError) and inner.preempted


def _looks_like_a_lost_peer(error: Exception) -> bool:
    inner = getattr(error, "health_check_failure", error)
    return isinstance(inner, RayActorError) or any(s in str(error).lower() for s in PEER_LOST)


def _node_gone(node: dict[str, Any] | None) -> bool:
    if node is None or not node.get("Alive", True):
        return True
    return not gcs_reachable(f"{node.get('NodeManagerAddress')}:{node.get('NodeManagerPort')}", timeout_s=1.0)


def gone_nodes(node_ids: set[str], confirm_s: float = CONFIRM_S, every_s: float = 0.5) -> set[str]:
    """Which of ``node_ids`` are gone (dead in the GCS, or their raylet unreachable), looking again for up to
    ``confirm_s`` until one is: a worker's death can be seen a moment before its machine's."""
    import ray

    deadline = time.monotonic() + confirm_s
    while True:
        nodes = {n["NodeID"]: n for n in ray.nodes()}
        gone = {i for i in node_ids if _node_gone(nodes.get(i))}
        if gone or time.monotonic() >= deadline:
            return gone
        time.sleep(every_s)


def silent_ranks(rank_actors: dict[int, Any], wait_s: float = HUNG_S) -> set[int]:
    """The ranks whose worker process does not answer Ray's ``__ray_ready__`` within ``wait_s``."""
    import ray

    if not rank_actors:
        return set()
    calls = {actor.__ray_ready__.remote(): rank for rank, actor in rank_actors.items()}
    _, pending = ray.wait(list(calls), num_returns=len(calls), timeout=wait_s)
    return {calls[ref] for ref in pending}


def _hung(errors: dict[int, Exception], rank_nodes: dict[int, str], rank_actors: dict[int, Any], hung_s: float
          ) -> WorkerGroupError | None:
    # Asked: the ranks that reported no error, and those whose health check Ray gave up on (a lone worker's hang
    # shows only there; its process may yet answer, if the poll was merely slow).
    asked = {r: a for r, a in rank_actors.items() if r not in errors or ray_private.health_check_timed_out(errors[r])}
    silent = silent_ranks(asked, hung_s)
    if not silent:
        return None
    failures = dict(errors)
    for rank in sorted(silent):
        failures[rank] = MachineLostError(f"rank {rank} (node {rank_nodes.get(rank)}) stopped answering for "
                                          f"{hung_s:g} s after its group failed or its health check timed out: "
                                          "its machine or process is hung")
    return WorkerGroupError(error_message=f"rank(s) {sorted(silent)} hung (no answer in {hung_s:g} s)",
                            worker_failures=failures)


def reclassify(errors: dict[int, Exception], rank_nodes: dict[int, str], confirm_s: float = CONFIRM_S,
               rank_actors: dict[int, Any] | None = None, hung_s: float = HUNG_S) -> WorkerGroupError | None:
    """The group's failure with the ranks of gone machines, or of silent ones (``rank_actors``), as
    ``MachineLostError``; None when no machine of the group is gone or hung (or Ray already counts the failure as
    a preemption)."""
    if not errors or any(_preempted(e) for e in errors.values()) or not rank_nodes:
        return None
    wait = confirm_s if any(_looks_like_a_lost_peer(e) for e in errors.values()) else 0.0
    gone = gone_nodes(set(rank_nodes.values()), wait)
    if not gone:
        return _hung(errors, rank_nodes, rank_actors or {}, hung_s)
    failures = dict(errors)
    for rank, node in sorted(rank_nodes.items()):
        if node in gone:
            was = f": {errors[rank]}" if rank in errors else ""
            failures[rank] = MachineLostError(f"the machine of rank {rank} (node {node}) went away without "
                                              f"notice{was}")
    lost = [r for r, n in rank_nodes.items() if n in gone]
    message = f"machine(s) of rank(s) {lost} went away without notice ({len(gone)} node(s) gone)"
    return WorkerGroupError(error_message=message, worker_failures=failures)


class MachineLossCallback(ray_private.WorkerGroupCallback):
    def __init__(self, confirm_s: float = CONFIRM_S, hung_s: float = HUNG_S):
        self.confirm_s, self.hung_s = confirm_s, hung_s
        self.rank_nodes: dict[int, str] = {}
        self.rank_actors: dict[int, Any] = {}

    def after_worker_group_start(self, worker_group: Any) -> None:
        try:
            self.rank_nodes = ray_private.worker_group_nodes(worker_group)
            self.rank_actors = ray_private.worker_group_actors(worker_group)
        except Exception as exc:  # never fail a start over this; losses are then Ray's to judge
            self.rank_nodes, self.rank_actors = {}, {}
            log.warning("could not read the worker group's nodes (%s): a machine lost without notice or hung will "
                        "be charged to scaling.max_failures", exc)

    def after_worker_group_poll_status(self, worker_group_status: Any) -> None:
        try:
            failure = reclassify(worker_group_status.errors, self.rank_nodes, self.confirm_s, self.rank_actors,
                                 self.hung_s)
        except Exception as exc:  # an error here would end the run as a controller error: leave it to Ray
            log.warning("could not tell whether a machine of the worker group went away: %s", exc)
            return
        if failure is not None:
            log.warning("worker group failed: %s; charged to the preemption budget, not scaling.max_failures",
                        failure)
            raise failure  # Ray Train's controller hands it to its failure policy as it is
