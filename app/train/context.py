"""What the per-worker ``Trainer`` asks of whoever runs it: its rank, its data, where a checkpoint goes.

Two runners provide it. ``RayTrainContext`` is the normal one: the worker is one of a Ray Train
``TorchTrainer`` worker group, so every call goes to ``ray.train``. ``LocalContext`` is for a run of one
worker inside the calling process (``app/train/inline.py``: a search trial of one worker, which would
otherwise pay for a whole worker-group start before its first step): the data streams are handed in, and a
checkpoint is written to the run folder directly, in the same layout Ray Train gives it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from lightray import storage
from lightray.train.state import list_checkpoints


class RayTrainContext:
    """The calling Ray Train worker's context."""

    def __init__(self) -> None:
        import ray.train

        self._train = ray.train
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.log = None  # the trainer logs to the run's log actor

    def dataset_shard(self, name: str) -> Any:
        return self._train.get_dataset_shard(name)

    def report_checkpoint(self, metrics: dict[str, Any], folder: str, name: str) -> None:
        """Ray Train copies ``folder`` to ``<run>/<name>`` and keeps the newest ``checkpoint.keep``."""
        self._train.report(metrics, checkpoint=self._train.Checkpoint.from_directory(folder),
                           checkpoint_dir_name=name)

    def preemption_info(self) -> Any:
        return self._train.get_preemption_info()

    def topology(self):
        from lightray.comm.topology import topology_from_ray

        return topology_from_ray()


class LocalContext:
    """One worker in this process: rank 0 of 1, the streams given, checkpoints written to ``run_dir``.

    ``on_report`` gets the metrics of every checkpoint report (what Ray Train's callbacks would get)."""

    def __init__(self, run_dir: str, shards: dict[str, Any], keep: int,
                 on_report: Callable[[dict[str, Any]], None] | None = None,
                 log: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.rank, self.world = 0, 1
        self.run_dir, self.shards, self.keep, self.on_report = run_dir, shards, keep, on_report
        self.log = log  # where the trainer's records go (None: the run's log actor, as in a worker group)

    def dataset_shard(self, name: str) -> Any:
        return self.shards[name]

    def report_checkpoint(self, metrics: dict[str, Any], folder: str, name: str) -> None:
        dest = storage.join(self.run_dir, name)
        # The meta files last: a copy cut short leaves a folder without its meta, which resume skips.
        files = sorted(os.listdir(folder), key=lambda f: f.startswith("meta_"))
        for fname in files:
            with open(os.path.join(folder, fname), "rb") as f:
                storage.write_bytes(storage.join(dest, fname), f.read())
        for _samples, old in list_checkpoints(self.run_dir)[self.keep:]:  # newest first, as Ray Train keeps them
            storage.remove(old)
        if self.on_report is not None:
            self.on_report(metrics)

    def preemption_info(self) -> Any:
        return None  # no Ray Train controller watches the node; a lost node fails the trial (Tune decides)

    def topology(self):
        from lightray.comm.topology import Topology

        return Topology.simulated(1, 0, 1)


def current_train_run_id() -> str | None:
    """This worker's Ray Train run id (one per ``fit()``, so one per driver attempt); None outside Ray Train."""
    from lightray import ray_private

    return ray_private.train_run_id()
