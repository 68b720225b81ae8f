"""Each phase's data stream opened before its first step (``scaling.stream_ahead``, off by default).

Why: a phase's stream is one Ray Data execution over all its epochs, and an execution starts slowly: the
streaming executor is built, its first map tasks are scheduled (on a fresh cluster, into worker processes that
are still importing), and only then does a batch arrive. Opened when the phase's first step asks for it, that
start is time the training thread waits. On the demo (2 CPUs, one run) the first step waited 2.9 s for data,
and the first tenth of each later phase took 0.8-1.9 s longer than the same tenth of its later epochs.

With the unit on, the stream of the phase a start begins in is opened while the model and its DDP wrapper are
built, and the stream of each next phase at the start of the current phase's last epoch. "Opened" means its
loader thread (:class:`~lightray.train.prefetch.DevicePrefetcher`) has asked for the first batch: Ray Data then
runs ahead by as much as its own back-pressure lets it (``prefetch_batches`` and its output budget), no further.

Why off by default: on this project's 2-CPU machine it did not pay (``python -m bench.unit_ab --set
scaling.stream_ahead=true``, docs/BENCHMARKS.md). There the start is CPU work on the cores the step uses
(worker processes importing, the phase's map tasks running ahead, the executor's thread in the training
process), so opening it early moves that work without freeing any, and the first phase's, moved into the
model's build, made the first step later. It is meant for nodes whose data CPUs are not the training device (a
GPU node), where the start is only waiting; that was not measured (no GPU machine yet).

Never opened early: phases whose decode placement waits for rank 0's on-device probe
(:func:`lightray.data.start_decode.needs_probe`), which must time the device before any rank asks for data, and
everything when ``scaling.device_prefetch`` is off (no loader thread to pull ahead with).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightray.train.prefetch import DevicePrefetcher


class PhaseStreams:
    """This rank's stream of each phase, opened once, ahead of its first step where allowed."""

    def __init__(self, shard: Callable[[str], Any], batch_size: Callable[[int], int], prefetch_batches: int,
                 device: torch.device, *, device_prefetch: bool, ahead: bool, probe_first: bool):
        """``shard(name)`` gives the dataset shard (the worker context's ``dataset_shard``); ``batch_size(i)``
        this rank's rows per step in phase ``i``; ``ahead`` is ``scaling.stream_ahead``; ``probe_first``: rank 0
        times decode on its device before any rank may ask for data."""
        self._shard, self._batch_size = shard, batch_size
        self.prefetch_batches, self.device, self.device_prefetch = prefetch_batches, device, device_prefetch
        self.setting, self.probe_first = ahead, probe_first
        self.ahead = ahead and device_prefetch and not probe_first
        self._open: dict[int, DevicePrefetcher] = {}
        self.opened_at: dict[int, int] = {}  # samples seen when each phase's stream was opened ahead

    def describe(self) -> str:
        """The unit line for ``scaling.stream_ahead``."""
        if not self.setting:
            return "off (scaling.stream_ahead=false): each phase's stream starts at its first step"
        if not self.device_prefetch:
            return "off: it pulls with the device_prefetch loader thread, and scaling.device_prefetch=false"
        if self.probe_first:
            return "off: rank 0 times decode on its device before any rank asks for data (data.decode_on=auto)"
        return ("the first phase's stream opened while the model is built, each next phase's at the start of the "
                "current phase's last epoch")

    def _make(self, phase: int) -> DevicePrefetcher:
        source = self._shard(f"train_p{phase}").iter_batches(
            batch_size=self._batch_size(phase), batch_format="numpy", prefetch_batches=self.prefetch_batches,
            drop_last=False)
        return DevicePrefetcher(iter(source), self.device, enabled=self.device_prefetch)

    def open_ahead(self, phase: int, samples_seen: int) -> bool:
        """Start pulling ``phase``'s stream now, ``samples_seen`` into the run (when allowed and not already
        open); True when it did."""
        if not self.ahead or phase in self._open:
            return False
        stream = self._make(phase)
        stream.start()
        self._open[phase] = stream
        self.opened_at[phase] = samples_seen
        return True

    def take(self, phase: int) -> DevicePrefetcher:
        """``phase``'s stream for its first step: the one opened ahead, else opened now. The caller closes it."""
        stream = self._open.pop(phase, None)
        return stream if stream is not None else self._make(phase)

    def close(self) -> None:
        """Stop every stream opened ahead and not taken (a run that stopped or failed before its phase)."""
        for stream in self._open.values():
            stream.close()
        self._open.clear()
