"""Ray internals lightray depends on, in one place, each checked against the Ray it was written for (a leaf:
it imports nothing of the package, and Ray only when called).

Ray 2.60 has no public interface for these. Each one is looked up here, and ``check()`` says loudly (one
warning naming the missing attribute and the pinned version) when an upgrade moved it, instead of a caller
failing silently later.
"""

from __future__ import annotations

import logging
import os
import socket

PINNED = "2.60"
log = logging.getLogger(__name__)


def address_file(temp_dir: str | None = None) -> str:
    """This host's "current cluster" file (``/tmp/ray/ray_current_cluster`` by default)."""
    from ray._common.utils import get_ray_address_file

    return get_ray_address_file(temp_dir)


def check() -> list[str]:
    """The private names this module needs that this Ray no longer has (empty when all are there); each missing
    one is logged as a warning with the pinned version."""
    missing = []
    try:
        address_file()
    except (ImportError, AttributeError) as exc:
        missing.append(f"ray._common.utils.get_ray_address_file ({exc})")
    try:
        if not preemption_has_its_own_budget():
            missing.append("the preemption budget for a worker error marked preempted (spot notices will be "
                           "charged to scaling.max_failures)")
    except (ImportError, AttributeError, TypeError) as exc:
        missing.append(f"ray.train.v2's _is_preemption_failure ({exc}); spot notices may be charged to "
                       f"scaling.max_failures")
    import ray

    for name in missing:
        log.warning("lightray was written for Ray %s; Ray %s lacks %s", PINNED, ray.__version__, name)
    return missing


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


def drop_stale_cluster_address(temp_dir: str | None = None) -> str | None:
    """Remove this host's "current cluster" file (``/tmp/ray/ray_current_cluster``) when nothing answers at the
    address it names; returns that address, or None when the file is absent or live.

    ``ray start`` and ``ray.cluster_utils.Cluster`` write the file, and only ``ray stop`` removes it, so a cluster
    that died or was killed leaves it behind. Ray's State API reads it whenever no address is given, which is
    how Ray Train's placement-group cleaner asks whether its controller lives: against a dead address each
    question waits out 20 retries, and every run's end waits 12 s for the cleaner to stop (measured here: a
    smoke run took 57 s with the stale file and 44 s without)."""
    try:
        path = address_file(temp_dir)
    except (ImportError, AttributeError):
        return None  # check() has said so
    try:
        with open(path) as f:
            address = f.read().strip()
    except OSError:
        return None
    if not address or _answers(address):
        return None
    try:
        os.remove(path)
    except OSError:
        return None
    return address
