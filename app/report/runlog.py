"""The run log: one small Ray actor on the driver's node that owns ``metrics.jsonl`` and TensorBoard.

Rank 0 sends it metrics and events with fire-and-forget calls, so a worker never waits on a file
system (the run folder can be on S3 while the driver tails a local file), and the driver's progress
line, summary and report all read one file. It outlives worker-group restarts, which makes it the
natural place to count them and to measure the work each failure lost.
"""

from __future__ import annotations

import json
import time
from typing import Any

import ray

from lightray import storage

NAMESPACE = "lightray"


def actor_name(run_name: str) -> str:
    return f"runlog-{run_name}"


class RunLogWriter:
    """Appends the run's records to metrics.jsonl (and TensorBoard). Runs as the ``RunLog`` actor, so that
    every worker of a group logs to one file; a run of one worker in its own process keeps it in-process
    (``app/train/inline.py``: no actor to start, and nothing queued is lost when the process is stopped)."""

    def __init__(self, local_dir: str, tensorboard: bool = True):
        storage.makedirs(local_dir)
        self.path = storage.join(local_dir, "metrics.jsonl")
        storage.drop_partial_last_line(self.path)  # a driver killed mid-write (resume appends after it)
        self.tb_dir = storage.join(local_dir, "tensorboard") if tensorboard else None
        self._tb = None
        self.last: dict[str, Any] = {}
        self.units: dict[str, dict[str, Any]] = {}  # the newest record of each unit, for latest_unit
        # Open the TensorBoard writer now, while the actor is fresh: a late first import (torch's writer, which
        # this once used) was seen to fail in this long-lived process on a 0-CPU head node.
        self._writer()

    def _writer(self, purge_step: int | None = None):
        if self._tb is None and self.tb_dir:
            from lightray.report.tensorboard_log import TBLogger

            self._tb = TBLogger(self.tb_dir, purge_step=purge_step)
        return self._tb

    def log(self, record: dict[str, Any]) -> None:
        record = dict(record, time=record.get("time", time.time()))
        storage.append_text(self.path, json.dumps(record) + "\n")
        if record.get("event") == "restart" and self._tb is not None:
            # Steps after the resumed checkpoint are replayed: drop their old points from TensorBoard.
            self._tb.close()
            self._tb = None
            self._writer(purge_step=int(record.get("samples_seen", 0)))
        if record.get("event") == "unit" and "unit" in record:
            self.units[record["unit"]] = record
        if "event" not in record:
            self.last = record
            tb = self._writer()
            if tb is not None:
                tb.scalars(record, int(record.get("samples_seen", 0)))

    def latest_unit(self, unit: str) -> dict[str, Any] | None:
        """The newest record of ``unit`` logged so far (a worker's measurement that the data plan reads)."""
        return self.units.get(unit)

    def flush(self) -> str:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        return self.path


RunLog = ray.remote(num_cpus=0)(RunLogWriter)


def get_runlog(run_name: str):
    try:
        return ray.get_actor(actor_name(run_name), namespace=NAMESPACE)
    except ValueError:
        return None


def latest_unit(run_name: str, unit: str) -> dict[str, Any] | None:
    """The newest record of ``unit`` in the run's log actor (None: no run log, or none logged yet)."""
    runlog = get_runlog(run_name)
    return ray.get(runlog.latest_unit.remote(unit)) if runlog is not None else None


def start_runlog(run_name: str, local_dir: str, tensorboard: bool = True):
    """Create the run's log actor on this (the driver's) node, replacing a stale one."""
    old = get_runlog(run_name)
    if old is not None:
        ray.kill(old)
    node = ray.get_runtime_context().get_node_id()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return RunLog.options(name=actor_name(run_name), namespace=NAMESPACE, lifetime=None,
                          scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                          ).remote(local_dir, tensorboard)
