"""Ray internals lightray depends on, in one place, each checked against the Ray it was written for (a leaf:
it imports nothing of the package, and Ray only when called).

Ray 2.60 has no public interface for these. Each one is looked up here, and ``check()`` says loudly (one
warning naming the missing attribute and the pinned version) when an upgrade moved it, instead of a caller
failing silently later.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import socket
from typing import Any

PINNED = "2.60"
log = logging.getLogger(__name__)


def address_file(temp_dir: str | None = None) -> str:
    """This host's "current cluster" file (``/tmp/ray/ray_current_cluster`` by default)."""
    from ray._common.utils import get_ray_address_file

    return get_ray_address_file(temp_dir)


# The autoscaling coordinator Ray Data and Ray Train book resources through (name, namespace): a dead driver's
# bookings are cancelled there (app/driver/stale_runs.py).
AUTOSCALING_COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")


def __getattr__(name: str):
    # Ray Train's worker-group callback base (tune/free.py subclasses it), resolved on first use so that this
    # module imports no Ray until asked.
    if name == "WorkerGroupCallback":
        from ray.train.v2._internal.execution.callback import WorkerGroupCallback

        return WorkerGroupCallback
    raise AttributeError(name)


def _probe_coordinator() -> bool:
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as dac

    source = inspect.getsource(dac.get_or_create_autoscaling_coordinator)
    name, namespace = AUTOSCALING_COORDINATOR
    return (f'name="{name}"' in source and f'namespace="{namespace}"' in source
            and "requester_id" in inspect.signature(dac._AutoscalingCoordinatorActor.cancel_request).parameters)


def _probe_actor_table() -> bool:
    from ray._private.state import GlobalState

    return {"job_id", "actor_state_name"} <= set(inspect.signature(GlobalState.actor_table).parameters)


def _probe_drain() -> bool:
    from ray._private import worker
    from ray._private.state import GlobalState
    from ray.core.generated import autoscaler_pb2

    autoscaler_pb2.DrainNodeReason.Value(DRAIN_REASON)
    return hasattr(worker, "global_worker") and hasattr(GlobalState, "get_draining_nodes")


def _probe_callback_error_is_the_failure() -> bool:
    # MachineLossCallback (app/driver/machine_loss.py) raises a WorkerGroupError from a worker-group callback's
    # after_worker_group_poll_status: it must reach the failure policy as it is, not wrapped as a (non-retryable)
    # controller error; and it reads the workers' node ids and actor handles from the group's state.
    from ray.train.v2._internal.execution.controller.controller import TrainController
    from ray.train.v2._internal.execution.worker_group.worker import ActorMetadata, Worker
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    poll = inspect.getsource(WorkerGroup.poll_status)
    loop = inspect.getsource(TrainController._run_control_loop_iteration)
    return ("after_worker_group_poll_status" in poll and "isinstance(e, TrainingFailedError)" in loop
            and "node_id" in ActorMetadata.__dataclass_fields__ and "actor" in Worker.__dataclass_fields__
            and hasattr(WorkerGroup, "get_worker_group_state"))


def _probe_train_context() -> bool:
    from ray.train.v2._internal.execution.context import get_train_context

    return callable(get_train_context)


def _probe_placement_group_id() -> bool:
    from ray._raylet import JobID, PlacementGroupID

    job = JobID.from_int(7)
    return placement_group_job_id(PlacementGroupID.of(job).hex()) == job.hex()


# The GCS port a cluster that ray.init starts takes from the environment (ray._private.node; 0 = any free port).
GCS_PORT_ENV = "RAY_GCS_SERVER_PORT"


def _probe_gcs_port_env() -> bool:
    from ray._private import ray_constants

    return ray_constants.GCS_PORT_ENVIRONMENT_VARIABLE == GCS_PORT_ENV


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def own_address_for_a_local_cluster():
    """While a local cluster starts (ray.init(address="local")), give its processes its own address.

    A process of a cluster that asks Ray's State API without an address (Ray Train's placement-group cleaner asks
    whether its run's controller lives, every second) is sent to RAY_ADDRESS, else to the cluster this host's
    `ray start` recorded, else to the one GCS it finds running. A cluster that ray.init starts records nothing.
    So beside another cluster on the host, the cleaner asked that one, found no controller, and removed the run's
    placement group, which kills its workers: a user who runs `lightray train --scaling.ray_address=local` beside
    a `ray start` cluster (traced here 2026-12-06; tests/test_cluster_address.py). So the GCS port is chosen
    here, and the raylet and every worker inherit RAY_ADDRESS naming it. The driver's own environment is given
    back after the start. Yields the address; a port the user set in RAY_GCS_SERVER_PORT is kept."""
    import ray

    port = int(os.environ.get(GCS_PORT_ENV) or 0) or free_port()
    address = f"{ray.util.get_node_ip_address()}:{port}"
    saved = {key: os.environ.get(key) for key in (GCS_PORT_ENV, "RAY_ADDRESS")}
    os.environ[GCS_PORT_ENV], os.environ["RAY_ADDRESS"] = str(port), address
    try:
        yield address
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _probes() -> dict[str, object]:
    """What each private interface lightray uses must look like in the pinned Ray: name -> a check that
    returns True, or False / raises when it changed."""
    return {
        "ray._common.utils.get_ray_address_file": lambda: bool(address_file()),
        f"{GCS_PORT_ENV}, the GCS port of a cluster ray.init starts (a private run beside another cluster would "
        "have Ray Train's placement-group cleaner ask that one, and remove the run's placement group)":
            _probe_gcs_port_env,
        "ray.train.v2's _is_preemption_failure charging a worker error marked preempted to "
        "max_preemption_failures (spot notices would use up scaling.max_failures)": preemption_has_its_own_budget,
        "ray.train.v2._internal.execution.callback.WorkerGroupCallback":
            lambda: isinstance(__getattr__("WorkerGroupCallback"), type),
        "ray.train.v2._internal.execution.context.get_train_context": _probe_train_context,
        "Ray Train's controller handing a WorkerGroupError raised in a worker-group callback's poll hook to its "
        "failure policy as is, and the workers' node ids and actors (machines lost without notice or hung would be "
        "charged to scaling.max_failures)":
            _probe_callback_error_is_the_failure,
        "ray._private.state.GlobalState.actor_table(job_id=, actor_state_name=)": _probe_actor_table,
        "the GCS client's drain_node and GlobalState.get_draining_nodes (spot notices)": _probe_drain,
        "ray._raylet.PlacementGroupID, ending with its job's id": _probe_placement_group_id,
        f"ray.train.v2's WorkerHealthCheckTimeoutError and {HEALTH_CHECK_TIMEOUT_ENV} (a hung lone worker would "
        "be charged to scaling.max_failures)": _probe_health_check_timeout,
        f"ray.train.v2's {START_TIMEOUT_ENV}, handed from the driver to the controller (an elastic run's group "
        "restarting after a spot notice would wait a minute for its draining machine)": _probe_start_timeout,
        f"ray.data's autoscaling coordinator named {AUTOSCALING_COORDINATOR} with cancel_request(requester_id) "
        "(a killed driver's bookings would hold its run back 3 minutes)": _probe_coordinator,
    }


def check() -> list[str]:
    """The private interfaces this module needs that this Ray no longer has in the expected shape (empty when all
    are there); each one missing is logged as a warning with the pinned version."""
    missing = []
    for name, probe in _probes().items():
        try:
            ok = probe()
        except (ImportError, AttributeError, TypeError, ValueError, OSError) as exc:
            missing.append(f"{name} ({type(exc).__name__}: {exc})")
            continue
        if not ok:
            missing.append(name)
    import ray

    for name in missing:
        log.warning("lightray was written for Ray %s; Ray %s lacks %s", PINNED, ray.__version__, name)
    return missing


DRAIN_REASON = "DRAIN_NODE_REASON_PREEMPTION"


def drain_node(node_id: str, message: str, deadline_ms: int) -> tuple[bool, str]:
    """Drain ``node_id`` with reason PREEMPTION through the connected worker's GCS client (as ``ray drain-node``
    does, with the cluster's auth); returns (accepted, rejection)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._private.worker.global_worker.gcs_client
    if not hasattr(gcs, "drain_node"):
        raise RuntimeError(f"lightray was written for Ray {PINNED}; Ray {ray.__version__}'s GCS client has no "
                           "drain_node, so spot notices cannot drain their node")
    reason = autoscaler_pb2.DrainNodeReason.Value(DRAIN_REASON)
    # 0 means "no deadline" to the GCS, so a deadline is always at least 1 ms.
    accepted, rejection = gcs.drain_node(node_id, reason, message, max(1, int(deadline_ms)))
    return bool(accepted), str(rejection or "")


def draining_node_ids() -> set[str]:
    """Ids (hex) of the nodes being drained now."""
    from ray._private.state import state

    return set(state.get_draining_nodes() or {})


def alive_actors(job_id: str) -> list[dict]:
    """The live actors of the Ray job ``job_id`` (hex), filtered by the GCS (not the whole table, dead actors
    included, as a poll every few seconds would otherwise fetch)."""
    import ray
    from ray._private.state import state

    return list(state.actor_table(None, job_id=ray.JobID.from_hex(job_id), actor_state_name="ALIVE").values())


def train_run_id() -> str | None:
    """This worker's Ray Train run id (one per ``fit()``); None outside a Ray Train worker."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return str(get_train_context().train_run_context.run_id)
    except Exception:  # a run in the driver's own process (app/train/inline.py): check() names a moved interface
        return None


def worker_group_nodes(worker_group) -> dict[int, str]:
    """World rank -> node id (hex) of each worker of a Ray Train worker group (its workers are in rank order)."""
    workers = worker_group.get_worker_group_state().workers
    return {rank: str(w.metadata.node_id) for rank, w in enumerate(workers)}


HEALTH_CHECK_TIMEOUT_ENV = "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"
# How long Ray Train waits for a new worker group's placement group before it decides the group's size again;
# the driver sets it and Ray Train hands it on to its controller (ENV_VARS_TO_PROPAGATE).
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


def health_check_timed_out(error: Exception) -> bool:
    """Whether a worker's error is Ray Train's health-check timeout: the controller's poll of the worker went
    unanswered for ``RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S`` (a stopped or wedged process; a lone worker has
    no peer whose collective would time out instead)."""
    from ray.train.v2._internal.exceptions import WorkerHealthCheckTimeoutError

    return isinstance(error, WorkerHealthCheckTimeoutError)


def _probe_health_check_timeout() -> bool:
    from ray.train.v2._internal import constants
    from ray.train.v2._internal.exceptions import WorkerHealthCheckTimeoutError

    return constants.WORKER_HEALTH_CHECK_TIMEOUT_S_ENV_VAR == HEALTH_CHECK_TIMEOUT_ENV and \
        health_check_timed_out(WorkerHealthCheckTimeoutError("probe"))


def _probe_start_timeout() -> bool:
    from ray.train.v2._internal import constants

    return constants.WORKER_GROUP_START_TIMEOUT_S_ENV_VAR == START_TIMEOUT_ENV and \
        START_TIMEOUT_ENV in constants.ENV_VARS_TO_PROPAGATE


def worker_group_actors(worker_group) -> dict[int, Any]:
    """World rank -> actor handle of each worker of a Ray Train worker group."""
    return dict(enumerate(w.actor for w in worker_group.get_worker_group_state().workers))


def placement_group_job_id(pg_hex: str) -> str:
    """The hex id of the job that created the placement group ``pg_hex``: Ray's placement-group table names no
    job, and a placement group's id ends with its job's (``PlacementGroupID.of``), which check() confirms."""
    from ray._raylet import JobID

    return pg_hex[-2 * JobID.size():]


def placement_group_from_hex(pg_hex: str):
    """A ``PlacementGroup`` handle for a recorded id (Ray has no public constructor from an id)."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup

    return PlacementGroup(PlacementGroupID(bytes.fromhex(pg_hex)))


def preemption_has_its_own_budget() -> bool:
    """Whether Ray Train charges a worker group that failed with a ``RayActorError`` marked ``preempted`` to
    ``max_preemption_failures`` rather than ``max_failures``. lightray's ``PreemptedError`` (raised after a spot
    notice's checkpoint) is such an error; Ray 2.60 decides this in ``_is_preemption_failure``, which is private,
    so it is asked here with the error shape lightray raises."""
    from ray.exceptions import RayActorError
    from ray.train.v2._internal.execution.failure_handling.default import _is_preemption_failure
    from ray.train.v2.api.exceptions import WorkerGroupError

    failed = WorkerGroupError(error_message="probe", worker_failures={0: RayActorError(preempted=True)})
    return bool(_is_preemption_failure(failed))


def _answers(address: str, timeout_s: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def recorded_cluster_address(temp_dir: str | None = None) -> str | None:
    """The address in this host's "current cluster" file, or None when there is none. ``ray start`` (and so
    ``ray up`` and KubeRay's head) and ``ray.cluster_utils.Cluster`` write it; a cluster that ``ray.init`` starts
    inside one program does not. That program's cluster ends with it, so it is not one to join."""
    try:
        path = address_file(temp_dir)
    except (ImportError, AttributeError):
        return None  # check() has said so
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def drop_stale_cluster_address(temp_dir: str | None = None) -> str | None:
    """Remove this host's "current cluster" file (``/tmp/ray/ray_current_cluster``) when nothing answers at the
    address it names; returns that address, or None when the file is absent or live.

    ``ray start`` and ``ray.cluster_utils.Cluster`` write the file, and only ``ray stop`` removes it, so a cluster
    that died or was killed leaves it behind. Ray's State API reads it whenever no address is given, which is
    how Ray Train's placement-group cleaner asks whether its controller lives: against a dead address each
    question waits out 20 retries, and every run's end waits 12 s for the cleaner to stop (measured here: a
    smoke run took 57 s with the stale file and 44 s without)."""
    address = recorded_cluster_address(temp_dir)
    if not address or _answers(address):
        return None
    try:
        os.remove(address_file(temp_dir))
    except OSError:
        return None
    return address
