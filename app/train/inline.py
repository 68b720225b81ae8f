"""A run of one worker in the calling process: the same ``Trainer``, data streams and checkpoints as a
Ray Train run, without the worker group.

Why: a Ray Train run starts a controller actor and a worker process that imports torch and joins a
process group before its first step: about 9 s on a quiet 2-core machine (``bench.ray_train_floor``),
whatever the run does after. A search trial of one worker on a short proxy budget spends as long starting
as training, so a search's trial-seconds go to start-ups. Ray's own advice for trials that do not need
distributed training is to train inside the Tune trial; this is that, for lightray's trainer.

What it keeps: the datasets are built by the same functions at the same resume point and configured by
the same ``PlanDataConfig``; the trainer is ``Trainer`` with a ``LocalContext``, logging to metrics.jsonl
in-process (``RunLogWriter``, no log actor to start); checkpoints land in the
run folder in Ray Train's layout (``checkpoint_<samples>``, newest ``checkpoint.keep`` kept), so a
restarted trial resumes from them. What it drops: Ray Train's restarts (``scaling.max_failures``) and its
spot-notice checkpoints; a failure ends the trial, and Tune's failure policy decides what follows.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

from lightray.data.ingest import PlanDataConfig


class InlineTrainer:
    """``fit()`` trains ``train_loop_config`` on one worker here, with ``datasets`` (name -> factory)."""

    def __init__(self, train_loop_config: dict[str, Any], datasets: dict[str, Callable[[], Any]],
                 data_config: PlanDataConfig, *, keep: int, timeout_s: float, cpus: float,
                 on_report: Callable[[dict[str, Any]], None] | None = None,
                 log: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.config, self.datasets, self.data_config = train_loop_config, datasets, data_config
        self.keep, self.timeout_s, self.on_report, self.log = keep, timeout_s, on_report, log
        # Ray gives a worker of N CPUs N intra-op threads (at least 1); a run here uses the same, so that it
        # trains what the worker would (a float sum's order follows the thread count) and keeps to its share.
        self.threads = max(1, int(cpus))

    def fit(self) -> None:
        import torch
        import torch.distributed as dist

        from lightray.train.context import LocalContext
        from lightray.train.trainer import Trainer

        built = {name: make() for name, make in self.datasets.items()}  # at the resume point, like a group start
        shards = self.data_config.configure(built, world_size=1, worker_handles=None, worker_node_ids=None)[0]
        ctx = LocalContext(self.config["run_dir"], shards, self.keep, self.on_report, self.log)
        # DDP and the comm hook want a process group; a group of one is local and costs milliseconds.
        own_group = not dist.is_initialized()
        if own_group:  # NCCL on a GPU, as Ray Train's TorchConfig picks it; gloo on CPU
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=self.timeout_s))
        threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            Trainer.from_train_config(self.config, ctx=ctx).run()
        finally:
            torch.set_num_threads(threads)
            if own_group:
                dist.destroy_process_group()
