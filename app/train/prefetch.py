"""Batches that are on the device before the step asks for them (``scaling.device_prefetch``).

Without this the training thread pins each batch (a host memcpy of the whole batch) and then copies it to the
GPU on the compute stream, so the copy waits for the previous step's kernels and the next step's kernels
wait for the copy. Here a loader thread takes each batch from the data stream (Ray Data's iterator, which
already prefetches on the host), pins it and issues its host-to-device copy on a side stream with an event
behind it; the training thread makes its compute stream wait for that event (a device-side wait, no host
sync) and starts. The queue holds one batch: while the step runs on batch k, batch k+1 is copied, and
the loader thread is at most one batch further.

Only the arrays the step uses on the device (:data:`DEVICE_KEYS`) move; ids and epochs stay NumPy for the
host's checks and the sample log. A device-decode batch (``jpeg``) passes through untouched: its bytes are
decoded on the device from host memory (``lightray.data.device_decode``). On the CPU there is nothing to pin or
copy: the arrays become tensors over the same memory and the thread only keeps the order.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

DEVICE_KEYS = ("image", "label", "box", "flip")

log = logging.getLogger(__name__)

_END = object()


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


def pin_batch(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``batch`` with its :data:`DEVICE_KEYS` arrays as tensors, in page-locked memory when ``device`` is CUDA
    (so the copy can be asynchronous); on another device the tensors share the arrays' memory."""
    out = dict(batch)
    for key in DEVICE_KEYS:
        value = batch.get(key)
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(np.ascontiguousarray(value))
        if isinstance(value, torch.Tensor) and device.type == "cuda" and value.device.type == "cpu" \
                and not value.is_pinned():
            value = value.pin_memory()
        if value is not None:
            out[key] = value
    return out


class DevicePrefetcher:
    """Iterates ``source``'s batches in order, each with its :data:`DEVICE_KEYS` already on ``device``.

    ``enabled=False`` yields ``source``'s batches unchanged (the step then copies them itself). Call
    :meth:`close` when done early (a stopped run): it stops the loader thread."""

    def __init__(self, source: Iterator[dict[str, Any]], device: torch.device, enabled: bool = True):
        self.source, self.device, self.enabled = source, torch.device(device), enabled
        self.cuda = self.device.type == "cuda"
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._done = False

    @staticmethod
    def describe(device: torch.device, enabled: bool) -> str:
        """The unit line for ``scaling.device_prefetch`` on ``device``."""
        if not enabled:
            return "off (scaling.device_prefetch=false): each batch is pinned and copied on the compute stream " \
                   "by the training thread"
        if torch.device(device).type != "cuda":
            return f"batches handed over by a loader thread in order; nothing to pin or copy on {device}"
        return f"batches pinned in a loader thread and copied to {device} one step ahead on a side stream"

    def __iter__(self) -> DevicePrefetcher:
        return self

    @property
    def started(self) -> bool:
        """Whether the loader thread has been started (it reads ``source`` from then on)."""
        return self._thread is not None

    def start(self) -> None:
        """Start the loader thread now, before the first batch is asked for (it pulls from ``source`` at once).
        Disabled, there is no thread: ``source`` is read when the step asks."""
        if self.enabled and self._thread is None and not self._done:
            self._thread = threading.Thread(target=self._load, name="lightray-prefetch", daemon=True)
            self._thread.start()

    def __next__(self) -> dict[str, Any]:
        if not self.enabled:
            return next(self.source)
        if self._done:
            raise StopIteration
        self.start()
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failed):
            self._done = True
            raise item.exc
        batch, event = item
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)  # on the device: the host does not wait for the copy
            for key in DEVICE_KEYS:
                t = batch.get(key)
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    # Allocated on the side stream, used and freed on the compute stream: without this the
                    # allocator could hand the memory to the next copy while this step still reads it.
                    t.record_stream(stream)
        return batch

    def _load(self) -> None:
        try:
            stream = None
            if self.cuda:
                torch.cuda.set_device(self.device)  # the current device is per thread
                stream = torch.cuda.Stream(self.device)
            for batch in self.source:
                if self._stop.is_set():
                    return
                if not self._put(self._stage(batch, stream)):
                    return
            self._put(_END)
        except BaseException as exc:  # noqa: BLE001 - raised again in the training thread, in order
            self._put(_Failed(exc))

    def _stage(self, batch: dict[str, Any], stream: Any) -> tuple[dict[str, Any], Any]:
        if "jpeg" in batch:
            return batch, None
        pinned = pin_batch(batch, self.device)
        if stream is None:
            return pinned, None
        with torch.cuda.stream(stream):
            for key in DEVICE_KEYS:
                t = pinned.get(key)
                if isinstance(t, torch.Tensor):
                    pinned[key] = t.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return pinned, event

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        """Stop the loader thread (it may finish the batch it is reading) and drop what it had queued."""
        self._stop.set()
        self._done = True
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._thread is None or not self._thread.is_alive():
            # Ends the source's own work as well: Ray Data's iterator (a generator) shuts its execution down when
            # closed, where left alone its executor and prefetch threads run on in this process (a stopped run, a
            # stream opened ahead and never taken). Not while the loader thread may still be inside it.
            close = getattr(self.source, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as exc:  # noqa: BLE001 - cleanup: a failing shutdown must not replace the error
                    # that ended the phase (a lost node, a collective timeout), which the driver classifies
                    log.warning("closing the data stream's source failed: %s: %s", type(exc).__name__, exc)
