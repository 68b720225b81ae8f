"""Spot interruption watcher: turns the cloud's two-minute notice into a Ray node drain.

Nothing in Ray watches AWS's spot interruption notice, so a reclaimed node would simply vanish and the run
would lose everything since its last checkpoint. lightray starts one small actor per node (``num_cpus=0``,
pinned with a hard NodeAffinity) that polls the instance metadata service (IMDSv2) in a background thread.
When a notice appears it drains its own node with reason PREEMPTION and the notice's deadline, exactly as
``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N`` does (the same
``GcsClient.drain_node`` call). Ray Train's preemption watcher then reports the node through
``ray.train.get_preemption_info()``, and the training loop (app/train/worker.py) writes a checkpoint at the
same step on every rank before the machine goes.

The watcher never takes the run down: a metadata endpoint that is unreachable, slow or answers nonsense is
retried on the next poll and the error is counted in ``status()``.

Check that a node can reach its metadata service: ``python -m lightray.driver.spot_watcher --once``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from typing import Any

from lightray.config import ConfigError, ScalingConfig

logger = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
ACTION_PATH = "/latest/meta-data/spot/instance-action"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
TOKEN_TTL_S = 21600  # the longest IMDSv2 allows; one PUT per node per six hours
ACTIONS = ("terminate", "stop", "hibernate")
# AWS promises two minutes; used when a notice carries no usable time.
DEFAULT_NOTICE_S = 120.0
ACTOR_NAMESPACE = "lightray-spot"


class ImdsError(RuntimeError):
    """The metadata service answered, but not with a 200 notice or a 404 'no notice'."""


class NoticeError(ValueError):
    """A 200 answer whose body is not a spot notice; the message names the URL and what was expected."""


def check_endpoint(endpoint: str) -> str:
    """The endpoint without a trailing slash, or ConfigError naming ``scaling.spot_endpoint``."""
    parts = urllib.parse.urlsplit(str(endpoint))
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(
            f"scaling.spot_endpoint: bad value {endpoint!r}; expected an http(s) base URL such as "
            f"{DEFAULT_ENDPOINT!r}"
        )
    return str(endpoint).rstrip("/")


def parse_notice(body: bytes | str, source: str = ACTION_PATH, now: float | None = None) -> dict[str, Any]:
    """Parse an instance-action body into ``{"action", "time", "deadline_ms"}``.

    ``deadline_ms`` is the notice's time as unix milliseconds (what Ray's drain API takes); a notice without
    a time gets ``now + 120 s``, AWS's documented warning. Raises NoticeError naming ``source``.
    """
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        raise NoticeError(
            f"{source}: body {text[:80]!r} is not JSON; expected {{\"action\": ..., \"time\": ...}}"
        ) from None
    if not isinstance(data, dict):
        raise NoticeError(f"{source}: body {text[:80]!r} is not a JSON object; expected {{\"action\", \"time\"}}")
    action = data.get("action")
    if action not in ACTIONS:
        raise NoticeError(f"{source}: action {action!r}; expected one of {', '.join(ACTIONS)}")
    now = time.time() if now is None else now
    stamp = data.get("time")
    if stamp is None:
        deadline_ms = int((now + DEFAULT_NOTICE_S) * 1000)
    else:
        try:
            when = datetime.fromisoformat(str(stamp))
        except ValueError:
            raise NoticeError(
                f"{source}: time {stamp!r} is not an ISO 8601 time; expected e.g. '2026-11-30T12:00:00Z'"
            ) from None
        if when.tzinfo is None:  # IMDS times are UTC
            when = when.replace(tzinfo=timezone.utc)
        deadline_ms = int(when.timestamp() * 1000)
    return {"action": action, "time": stamp, "deadline_ms": deadline_ms}


class ImdsClient:
    """IMDSv2 client for the spot instance-action document.

    The session token is fetched once and reused until shortly before it expires (or until the service
    answers 401), so a poll is one GET. Requests bypass any HTTP proxy from the environment: the metadata
    address is link-local and a proxy would answer for the wrong machine.
    """

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 1.0, token_ttl_s: int = TOKEN_TTL_S):
        self.endpoint = check_endpoint(endpoint)
        self.timeout_s = timeout_s
        self.token_ttl_s = int(token_ttl_s)
        self._token: str | None = None
        self._token_expires = 0.0
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _token_value(self, refresh: bool = False) -> str:
        if refresh or self._token is None or time.monotonic() >= self._token_expires:
            url = self.endpoint + TOKEN_PATH
            req = urllib.request.Request(url, method="PUT", headers={TOKEN_TTL_HEADER: str(self.token_ttl_s)})
            try:
                with self._opener.open(req, timeout=self.timeout_s) as resp:
                    self._token = resp.read().decode().strip()
            except urllib.error.HTTPError as err:
                raise ImdsError(f"{url}: HTTP {err.code} {err.reason}; expected 200 with an IMDSv2 token") from None
            # Renew a minute early so a poll never presents a token that expires in flight.
            self._token_expires = time.monotonic() + max(1.0, self.token_ttl_s - 60)
        return self._token  # type: ignore[return-value]

    def instance_action(self) -> dict[str, Any] | None:
        """The pending spot notice, or None when there is none (404).

        Raises OSError (unreachable, timeout), ImdsError (unexpected status) or NoticeError (bad body).
        """
        url = self.endpoint + ACTION_PATH
        for attempt in range(2):
            req = urllib.request.Request(url, headers={TOKEN_HEADER: self._token_value(refresh=attempt > 0)})
            try:
                with self._opener.open(req, timeout=self.timeout_s) as resp:
                    return parse_notice(resp.read(), source=url)
            except urllib.error.HTTPError as err:
                if err.code == 404:
                    return None
                if err.code == 401 and attempt == 0:
                    continue  # token expired or the service restarted: fetch a new one once
                raise ImdsError(f"{url}: HTTP {err.code} {err.reason}; expected 200 (notice) or 404 (none)") from None
        raise AssertionError("unreachable")


def drain_node_for_preemption(node_id: str, deadline_ms: int, message: str) -> tuple[bool, str]:
    """Drain ``node_id`` with reason PREEMPTION, as ``ray drain-node`` does; returns (accepted, rejection).

    Needs a connected Ray worker or driver (uses its GCS client, which already carries the cluster's auth).
    """
    from lightray import ray_private

    return ray_private.drain_node(node_id, message, deadline_ms)


class SpotWatcher:
    """Polls the metadata service and drains this node on a spot notice.

    Used as a Ray actor by ``start_watchers`` (one per node) or directly in-process (``drain=False`` or an
    explicit ``node_id`` when not inside Ray). ``start()`` begins polling every ``poll_s`` in a daemon
    thread; ``poll_once()`` does one poll now.
    """

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, poll_s: float = 5.0, *, drain: bool = True,
                 node_id: str | None = None, run_name: str = "", timeout_s: float | None = None):
        # IMDS answers in milliseconds when it is there; 1-2 s rides out a loaded host without letting a
        # black-holed endpoint (not on AWS) stretch the poll interval much.
        timeout_s = min(2.0, max(1.0, poll_s)) if timeout_s is None else timeout_s
        self._client = ImdsClient(endpoint, timeout_s=timeout_s)
        self.poll_s = float(poll_s)
        self.run_name = run_name
        self._drain = drain
        if node_id is None and drain:
            import ray

            node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        self.node_id = node_id
        self._lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._polls = 0
        self._notices = 0
        self._errors = 0
        self._last_error = ""
        self._notice: dict[str, Any] | None = None
        self._drained = False
        self._drain_errors = 0
        self._drain_result = ""
        self._warned = False

    # -- polling -------------------------------------------------------------------------------------
    def poll_once(self) -> dict | None:
        """Poll once; returns the notice if there is one (and drains the node, once), else None."""
        # One poll at a time: the background thread and a direct call share the token and the drain.
        with self._poll_lock:
            with self._lock:
                self._polls += 1
            try:
                notice = self._client.instance_action()
            except (OSError, http.client.HTTPException, ImdsError, NoticeError) as err:
                self._record_error(err)
                return None
            if notice is None:
                return None
            with self._lock:
                self._notices += 1
                self._notice = notice
                drained = self._drained
            if self._drain and not drained:
                self._drain_now(notice)
            return notice

    def _record_error(self, err: BaseException) -> None:
        text = str(err) if isinstance(err, (ImdsError, NoticeError)) else (
            f"{self._client.endpoint}: {type(err).__name__}: {err}")
        with self._lock:
            self._errors += 1
            self._last_error = text
            first = not self._warned
            self._warned = True
        # One warning tells the operator the watcher is blind; repeating it every poll would flood the logs.
        if first:
            logger.warning("spot watcher (node %s): cannot read the metadata service (%s); retrying every %.1f s "
                           "quietly", self.node_id, text, self.poll_s)
        else:
            logger.debug("spot watcher poll failed: %s", text)

    def _drain_now(self, notice: dict[str, Any]) -> None:
        remaining = notice["deadline_ms"] / 1000 - time.time()
        message = (f"spot interruption notice: {notice['action']} at {notice['time']} "
                   f"(from {self._client.endpoint}, run {self.run_name or '-'})")
        if self.node_id is None:
            with self._lock:
                self._drain_errors += 1
                self._drain_result = "no node id: not running inside Ray"
            return
        logger.warning("spot watcher: %s; draining node %s (%.0f s left)", message, self.node_id, remaining)
        try:
            accepted, rejection = drain_node_for_preemption(self.node_id, notice["deadline_ms"], message)
        except Exception as err:  # a GCS hiccup must not stop the watcher; retried next poll
            accepted, rejection = False, f"{type(err).__name__}: {err}"
        with self._lock:
            if accepted:
                self._drained = True
                self._drain_result = "accepted"
            else:
                # Retried on the next poll (the notice stays up until the machine is gone).
                self._drain_errors += 1
                self._drain_result = f"rejected: {rejection}"
        if not accepted:
            logger.warning("spot watcher: drain of node %s not accepted: %s", self.node_id, rejection)

    # -- background thread --------------------------------------------------------------------------
    def start(self) -> bool:
        """Start polling in a daemon thread; a second call does nothing. Returns True when running."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return True
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="lightray-spot-watcher", daemon=True)
            self._thread.start()
        return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as err:  # the watcher outlives any one bad poll
                self._record_error(err)
            self._stop.wait(self.poll_s)

    def stop(self) -> None:
        """Stop the polling thread (waits for a poll in flight)."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=self.poll_s + self._client.timeout_s * 3 + 1)

    def status(self) -> dict:
        """Counters and state: polls, notices seen, drained (bool), errors, and details for the run log."""
        with self._lock:
            return {
                "node_id": self.node_id,
                "endpoint": self._client.endpoint,
                "run_name": self.run_name,
                "running": self._thread is not None and self._thread.is_alive(),
                "polls": self._polls,
                "notices": self._notices,
                "notice": dict(self._notice) if self._notice else None,
                "drained": self._drained,
                "drain_result": self._drain_result,
                "drain_errors": self._drain_errors,
                "errors": self._errors,
                "last_error": self._last_error,
            }


# -- the runner's side: one actor per node ------------------------------------------------------------
def _actor_name(run_name: str, node_id: str) -> str:
    return f"spot-watcher:{run_name}:{node_id}"


def watched_nodes(cfg: ScalingConfig) -> list[str]:
    """Node ids that get a watcher under ``cfg.spot_watcher``: alive, not already draining, and for
    ``auto`` with the default endpoint only nodes with GPUs (CPU-only head/ingest nodes are usually
    on-demand; a changed endpoint says the user wants every node watched)."""
    import ray

    mode = cfg.spot_watcher
    if mode == "off":
        return []
    if mode not in ("auto", "on"):
        raise ConfigError(f"scaling.spot_watcher: bad value {mode!r}; allowed: auto, on, off")
    every_node = mode == "on" or check_endpoint(cfg.spot_endpoint) != DEFAULT_ENDPOINT
    # A draining node accepts no new actors: a hard affinity to it would wait forever.
    from lightray import ray_private

    draining = ray_private.draining_node_ids()
    out = []
    for node in ray.nodes():
        if not node.get("Alive") or node["NodeID"] in draining:
            continue
        if every_node or node.get("Resources", {}).get("GPU", 0) > 0:
            out.append(node["NodeID"])
    return out


def start_watchers(cfg: ScalingConfig, run_name: str, node_ids: list[str] | None = None,
                   ready_timeout_s: float = 60.0) -> list:
    """Start (or find) one watcher actor per eligible node and return their handles.

    Idempotent per run: actors are named per (run, node), so calling it again (e.g. after a resize brought
    new nodes) returns the running ones and adds watchers only where missing. ``node_ids`` narrows the
    nodes (default: all that ``watched_nodes`` picks). Waits up to ``ready_timeout_s`` for the actors to
    start polling; one that is still pending is returned anyway (it starts when its node has room).
    """
    return list(_start_by_node(cfg, run_name, node_ids, ready_timeout_s).values())


def _start_by_node(cfg: ScalingConfig, run_name: str, node_ids: list[str] | None,
                   ready_timeout_s: float) -> dict[str, Any]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    endpoint = check_endpoint(cfg.spot_endpoint)
    if not run_name:
        raise ConfigError("spot watcher: run name is empty; expected the run's name (one watcher set per run)")
    nodes = watched_nodes(cfg)
    if node_ids is not None:
        wanted = set(node_ids)
        nodes = [n for n in nodes if n in wanted]
    actor_cls = ray.remote(SpotWatcher)
    by_node: dict[str, Any] = {}
    for node_id in nodes:
        by_node[node_id] = actor_cls.options(
            name=_actor_name(run_name, node_id), namespace=ACTOR_NAMESPACE, get_if_exists=True,
            num_cpus=0, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(endpoint, cfg.spot_poll_s, drain=True, node_id=node_id, run_name=run_name)
    if by_node:
        started = [h.start.remote() for h in by_node.values()]
        ready, pending = ray.wait(started, num_returns=len(started), timeout=ready_timeout_s)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as err:  # a node that died meanwhile must not stop the run
                logger.warning("spot watcher failed to start: %s", err)
        if pending:
            logger.warning("spot watcher: %d of %d watchers not started after %.0f s (nodes busy or gone)",
                           len(pending), len(by_node), ready_timeout_s)
        logger.info("spot watcher: watching %d node(s) at %s every %.1f s", len(by_node), endpoint,
                    cfg.spot_poll_s)
    return by_node


class WatcherKeeper:
    """Keeps a watcher on every eligible node for the length of a run, and none on a node that is going.

    ``start_watchers`` sees the nodes alive when it is called; on a spot cluster the nodes that matter most
    arrive later (the autoscaler's replacements for reclaimed machines, elastic scale-ups). The keeper looks
    for unwatched nodes every ``every_s`` seconds from a daemon thread in the driver and starts watchers
    there. Every ``retire_every_s`` it ends the watchers of nodes that are draining, keeping their last
    status: the notice is handled, and a watcher is an actor, which keeps a drained node from going idle. Ray
    retires an idle drained node at once; until then it counts the node's resources, and sizes the worker
    group that restarts after the notice's checkpoint onto it (measured: the group waited for the node until
    the notice's deadline). ``stop()`` ends the thread and the watchers.
    """

    def __init__(self, cfg: ScalingConfig, run_name: str, every_s: float = 30.0, retire_every_s: float = 2.0):
        self.cfg = cfg
        self.run_name = run_name
        self.every_s = float(every_s)
        self.retire_every_s = float(retire_every_s)
        self._by_node: dict[str, Any] = {}
        self._retired: dict[str, dict] = {}  # node id -> the last status of its watcher, ended on the drain
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0

    def refresh(self) -> int:
        """Start watchers on nodes that have none yet; returns how many were added."""
        with self._lock:
            known = set(self._by_node)
        missing = [n for n in watched_nodes(self.cfg) if n not in known]
        if not missing:
            return 0
        added = _start_by_node(self.cfg, self.run_name, missing, ready_timeout_s=max(5.0, self.every_s))
        with self._lock:
            self._by_node.update(added)
        return len(added)

    def start(self) -> WatcherKeeper:
        """Watch the nodes alive now (synchronously, so a notice right after start is not missed), then
        keep looking in the background."""
        if self.cfg.spot_watcher == "off":
            return self
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="lightray-spot-keeper", daemon=True)
        self._thread.start()
        return self

    def retire_draining(self) -> int:
        """End the watchers of the nodes that are draining now, keeping each one's last status; returns how
        many were ended. A draining node gets no new watcher (``watched_nodes``)."""
        from lightray import ray_private

        draining = ray_private.draining_node_ids()
        with self._lock:
            going = {n: h for n, h in self._by_node.items() if n in draining}
        for node, handle in going.items():
            last = watcher_statuses([handle], timeout_s=5.0)
            stop_watchers([handle])
            with self._lock:
                self._by_node.pop(node, None)
                self._retired[node] = last[0] if last else {"node_id": node, "drained": None,
                                                             "last_error": "no status before it was ended"}
            logger.info("spot watcher: node %s is draining; its watcher ended so that Ray can retire the node",
                        node)
        return len(going)

    def _loop(self) -> None:
        next_refresh = time.monotonic() + self.every_s
        while not self._stop.wait(min(self.every_s, self.retire_every_s)):
            try:
                self.retire_draining()
                if time.monotonic() >= next_refresh:
                    next_refresh = time.monotonic() + self.every_s
                    self.refresh()
            except Exception as err:  # a GCS hiccup must not end the run; next round retries
                self.errors += 1
                logger.debug("spot watcher keeper: refresh failed: %s", err)

    def statuses(self, timeout_s: float = 10.0) -> list[dict]:
        """The last status of every watcher the run had: those still up (asked now) and those ended on a drain."""
        with self._lock:
            retired = list(self._retired.values())
        return watcher_statuses(self.handles, timeout_s) + retired

    @property
    def handles(self) -> list:
        with self._lock:
            return list(self._by_node.values())

    @property
    def node_ids(self) -> list[str]:
        with self._lock:
            return list(self._by_node)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.every_s + 70)
        stop_watchers(self.handles)


def watcher_statuses(handles: list, timeout_s: float = 10.0) -> list[dict]:
    """``status()`` of every watcher that answers within ``timeout_s`` (a gone node's watcher is skipped)."""
    import ray

    refs = [h.status.remote() for h in handles]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    out = []
    for ref in ready:
        try:
            out.append(ray.get(ref))
        except Exception:  # the node (and its watcher) may already be reclaimed
            continue
    return out


def stop_watchers(handles: list) -> None:
    """Kill the watcher actors (those on reclaimed nodes are already gone; that is fine)."""
    import ray

    for handle in handles:
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # already dead
            continue


def main(argv: list[str] | None = None) -> int:
    """Probe the metadata service from this machine: prints one JSON line per poll."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--endpoint", default=DEFAULT_ENDPOINT)
    parser.add_argument("--poll-s", type=float, default=5.0)
    parser.add_argument("--once", action="store_true", help="poll once and exit")
    args = parser.parse_args(argv)
    try:
        watcher = SpotWatcher(args.endpoint, args.poll_s, drain=False)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    while True:
        notice = watcher.poll_once()
        status = watcher.status()
        print(json.dumps({"notice": notice, "errors": status["errors"], "last_error": status["last_error"]}),
              flush=True)
        if args.once:
            return 0 if status["errors"] == 0 else 1
        time.sleep(args.poll_s)


if __name__ == "__main__":
    raise SystemExit(main())
