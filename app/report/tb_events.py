"""A TensorBoard event-file writer on the ``tensorboard`` package alone (protobuf), without torch.

``torch.utils.tensorboard.SummaryWriter`` writes the same records, but importing it loads torch, about
300 MB in the run-log actor, a process that otherwise never needs torch. This writes what lightray logs
(scalars, text, and the purge marker a restart needs) with the same protos and file layout.
"""

from __future__ import annotations

import time

from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData
from tensorboard.summary.writer.event_file_writer import EventFileWriter


class EventWriter:
    """``add_scalar`` / ``add_text`` / ``flush`` / ``close`` as torch's SummaryWriter does them.

    ``purge_step``: TensorBoard drops the points an earlier writer left at steps >= this one (the replayed
    steps after a restart from a checkpoint)."""

    def __init__(self, log_dir: str, purge_step: int | None = None, flush_secs: int = 30, max_queue: int = 10):
        self._w = EventFileWriter(log_dir, max_queue_size=max_queue, flush_secs=flush_secs)
        if purge_step is not None:
            self._add(Event(step=int(purge_step), file_version="brain.Event:2"))
            self._add(Event(step=int(purge_step), session_log=SessionLog(status=SessionLog.START)))

    def _add(self, event: Event, step: int | None = None, walltime: float | None = None) -> None:
        event.wall_time = time.time() if walltime is None else walltime
        if step is not None:
            event.step = int(step)
        self._w.add_event(event)

    def add_scalar(self, tag: str, value: float, global_step: int | None = None,
                   walltime: float | None = None) -> None:
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])
        self._add(Event(summary=summary), global_step, walltime)

    def add_text(self, tag: str, text: str, global_step: int | None = None, walltime: float | None = None) -> None:
        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
            plugin_name="text", content=TextPluginData(version=0).SerializeToString()))
        tensor = TensorProto(dtype="DT_STRING", string_val=[text.encode("utf_8")],
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        summary = Summary(value=[Summary.Value(tag=tag + "/text_summary", metadata=meta, tensor=tensor)])
        self._add(Event(summary=summary), global_step, walltime)

    def flush(self) -> None:
        self._w.flush()

    def close(self) -> None:
        self._w.close()
