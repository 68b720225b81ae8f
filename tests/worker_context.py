"""What Ray Train gives a worker, for one rank of a test's own gloo group: the Trainer's context with checkpoint
folders gathered in the run folder as Ray Train gathers them. Each test gives its own streams."""

from __future__ import annotations

import os
import pathlib
import shutil
from typing import Any


class FolderContext:
    def __init__(self, rank: int, world: int, run_dir: str):
        self.rank, self.world, self.run_dir = rank, world, run_dir
        self.trainer: Any = None
        self.records: list[dict] = []

    def log(self, record: dict) -> None:
        self.records.append(record)

    def report_checkpoint(self, metrics: dict, folder: str, name: str) -> None:
        dest = pathlib.Path(self.run_dir) / name
        dest.mkdir(parents=True, exist_ok=True)
        for f in os.listdir(folder):
            shutil.copy(os.path.join(folder, f), dest / f)

    def preemption_info(self) -> Any:
        return None

    def topology(self):
        from lightray.comm.topology import Topology

        return Topology.simulated(self.world, self.rank, self.world)
