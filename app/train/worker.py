"""The per-worker training function run by Ray Train's TorchTrainer.

One call = one worker-group start: it builds this worker's ``Trainer`` (app/train/trainer.py), which
resumes from the checkpoint chosen for the start and trains the rest of the schedule.
"""

from __future__ import annotations

from lightray.train.trainer import PreemptedError, Trainer

__all__ = ["PreemptedError", "train_loop_per_worker"]


def train_loop_per_worker(config: dict) -> None:
    """``config`` is the TorchTrainer's ``train_loop_config``: cfg (as a dict), spec, run_dir, num_classes."""
    Trainer.from_train_config(config).run()
