"""What every attempt of a run cost in machine time, measured by the driver, rolled-back work included.

The counters in a checkpoint only carry the time up to that checkpoint: a restart resumes them and the
time spent after it (lost to the failure) disappears from the bill. The driver therefore meters the
cluster itself: while it runs, every ``every_s`` seconds each node that the run holds adds that interval to
the seconds of its price key (the node label ``lightray-price-key`` that cluster.yaml sets, else
``cost.node_type``). A node is the run's while it holds a bundle of one of the run's placement groups (the
worker group), one of its actors (the Train controller, the run log, Ray Data's actors), or its driver; so
two runs on one cluster are each billed for their own nodes. The run is its Ray job: placement group ids end
with the id of the job that created them, and GCS's actor table names each actor's job. Spot-notice
watchers sit on every eligible node with no resources, to watch, not to use it: they do not count. Ray Data
tasks on a node where the run holds nothing else are not seen (GCS keeps no node per running task without
the dashboard's state API).
``billing.json`` in the run folder keeps one entry per driver attempt, outside the checkpoints, and is
rewritten every ``flush_s`` so that a driver killed without warning still bills most of its time.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

from lightray import storage

log = logging.getLogger("lightray")
BILLING_NAME = "billing.json"
PRICE_LABEL = "lightray-price-key"


def read_billing(run_dir: str) -> dict[str, Any]:
    """``{"attempts": [...], "node_seconds": {price key: seconds}}`` of every attempt so far."""
    try:
        data = storage.read_json(storage.join(run_dir, BILLING_NAME))
    except (OSError, ValueError):
        return {"attempts": [], "node_seconds": {}}
    return data if isinstance(data, dict) and "attempts" in data else {"attempts": [], "node_seconds": {}}


# Actors a run places on nodes it does not otherwise use, holding no resources there (app/driver/spot_watcher.py)
OBSERVERS = frozenset({"SpotWatcher"})


def job_nodes(job_id: str) -> set[str]:
    """Ids of the nodes that the Ray job ``job_id`` (hex) holds now: its placement groups' bundles, its live
    actors (observers aside) and its driver's node."""
    import ray

    from lightray import ray_private  # GCS's actor table: no dashboard needed, unlike ray.util.state

    if not job_id:
        raise ValueError("job_nodes: empty job id; expected the hex id of a Ray job")
    nodes = {ray.get_runtime_context().get_node_id()}
    for pg in ray.util.placement_group_table().values():
        if pg.get("state") == "CREATED" and ray_private.placement_group_job_id(str(pg.get("placement_group_id"))) \
                == job_id:
            nodes.update(pg.get("bundles_to_node_id", {}).values())
    for actor in ray_private.alive_actors(job_id):
        if actor.get("ActorClassName") not in OBSERVERS:
            nodes.add((actor.get("Address") or {}).get("NodeID"))
    return nodes


def _node_keys(default_key: str, job_id: str) -> list[str]:
    """The price key of each live node that the job holds."""
    import ray

    held = job_nodes(job_id)
    return [(n.get("Labels") or {}).get(PRICE_LABEL) or default_key for n in ray.nodes()
            if n.get("Alive") and n.get("NodeID") in held]


class NodeMeter:
    """Adds node-seconds per price key while the driver runs; ``start()`` then ``stop()``."""

    def __init__(self, run_dir: str, default_key: str, *, every_s: float = 5.0, flush_s: float = 30.0):
        self.run_dir, self.default_key = run_dir, default_key
        self.every_s, self.flush_s = every_s, flush_s
        self.attempt = {"id": uuid.uuid4().hex[:12], "start": time.time(), "end": None, "node_seconds": {}}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last = time.time()
        import ray

        self.job_id = ray.get_runtime_context().get_job_id() if ray.is_initialized() else ""  # the run: its job

    def start(self) -> NodeMeter:
        self._last = time.time()
        self._thread = threading.Thread(target=self._loop, name="node-meter", daemon=True)
        self._thread.start()
        return self

    def sample(self) -> None:
        """Bill the time since the last sample to the nodes the run holds now."""
        now = time.time()
        try:
            keys = _node_keys(self.default_key, self.job_id)
        except Exception as exc:  # cluster gone or busy: bill the interval at the next sample that works
            log.debug("node meter: %s", exc)
            return
        with self._lock:
            dt, self._last = now - self._last, now
            secs = self.attempt["node_seconds"]
            for key in keys:
                secs[key] = secs.get(key, 0.0) + dt
            self.attempt["end"] = now

    def _loop(self) -> None:
        last_flush = time.time()
        while not self._stop.wait(self.every_s):
            self.sample()
            if time.time() - last_flush >= self.flush_s:
                self.flush()
                last_flush = time.time()

    def flush(self) -> dict[str, Any]:
        """Write this attempt into billing.json (replacing its earlier entry); returns the whole bill."""
        with self._lock:
            mine = {**self.attempt, "node_seconds": dict(self.attempt["node_seconds"])}
        bill = read_billing(self.run_dir)
        attempts = [a for a in bill["attempts"] if a.get("id") != mine["id"]] + [mine]
        total: dict[str, float] = {}
        for a in attempts:
            for key, secs in a.get("node_seconds", {}).items():
                total[key] = total.get(key, 0.0) + float(secs)
        bill = {"attempts": attempts, "node_seconds": total}
        try:
            storage.write_json(storage.join(self.run_dir, BILLING_NAME), bill, indent=1)
        except OSError as exc:
            log.warning("could not write %s: %s", BILLING_NAME, exc)
        return bill

    def stop(self) -> dict[str, Any]:
        """Last sample and flush; returns the bill of all attempts."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.sample()
        return self.flush()
