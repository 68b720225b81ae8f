"""``scaling.stream_ahead``: a phase's data stream is read before its first step asks for it
(app/train/phase_streams.py).

The streams here are real Ray Data iterators on the session's cluster, whose map task marks a file when it runs; the
trainer's wiring is read from the session's finished smoke run."""

from __future__ import annotations

import json
import pathlib
import threading

import numpy as np
import pytest
import torch

from lightray.train.phase_streams import PhaseStreams
from lightray.train.prefetch import DevicePrefetcher
from tests.faults import records, wait_for
from tests.finished_run import NAME

ROWS, PER_STEP = 12, 4


def _marked_stream(ray, marks: pathlib.Path):
    """A dataset whose map task leaves a file per block in ``marks`` when it runs (in a Ray worker process)."""
    def to_batch(block: dict, folder: str) -> dict:
        ids = np.asarray(block["id"], dtype=np.int64)
        pathlib.Path(folder, f"block_{int(ids[0])}").write_text("")
        return {"image": np.zeros((len(ids), 8, 8, 3), np.uint8), "label": ids % 3, "sample_id": ids,
                "epoch": np.zeros(len(ids), np.int64)}

    marks.mkdir()
    ds = ray.data.range(ROWS, override_num_blocks=3).map_batches(to_batch, batch_size=None,
                                                                 fn_kwargs={"folder": str(marks)})
    return ds.iterator()


def _streams(shards: dict, **switches) -> PhaseStreams:
    kwargs = {"device_prefetch": True, "ahead": True, "probe_first": False, **switches}
    return PhaseStreams(shards.__getitem__, lambda phase: PER_STEP, 1, torch.device("cpu"), **kwargs)


def test_a_stream_opened_ahead_is_read_before_its_first_step_asks(ray_local, tmp_path):
    marks = tmp_path / "marks"
    streams = _streams({"train_p1": _marked_stream(ray_local, marks)})
    try:
        assert streams.open_ahead(1, samples_seen=96)
        assert streams.opened_at == {1: 96}
        assert not streams.open_ahead(1, samples_seen=100)  # opened once
        stream = streams.take(1)
        # Nobody has asked the stream for a batch: its loader thread pulled through Ray Data on its own, whose map
        # task ran (a Ray Data execution starts only when its iterator is read).
        wait_for(lambda: list(marks.iterdir()), 120, "a map task of the stream opened ahead", interval=0.05)
        ids = np.concatenate([b["sample_id"] for b in stream])
        assert ids.tolist() == list(range(ROWS))  # every row once, in order
        stream.close()
    finally:
        streams.close()


@pytest.mark.parametrize("switches, why", [
    ({"ahead": False}, "scaling.stream_ahead=false"),
    ({"device_prefetch": False}, "scaling.device_prefetch=false"),
    ({"probe_first": True}, "rank 0 times decode on its device"),
])
def test_with_stream_ahead_off_a_stream_starts_at_its_first_step_and_the_unit_says_why(ray_local, tmp_path,
                                                                                       switches, why):
    streams = _streams({"train_p0": _marked_stream(ray_local, tmp_path / "marks")}, **switches)
    assert not streams.ahead and why in streams.describe()
    assert not streams.open_ahead(0, samples_seen=0) and streams.opened_at == {}
    stream = streams.take(0)
    assert not stream.started  # no loader thread until the first step asks
    first = next(stream)
    assert first["sample_id"].tolist() == list(range(PER_STEP))
    stream.close()


def _ray_data_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(("StreamingExecutor", "iter_threaded"))}


def test_closing_a_stream_part_read_ends_its_ray_data_execution(ray_local):
    """A stopped run, or a stream opened ahead and never taken: closing it must end Ray Data's execution in this
    process, whose executor and prefetch threads otherwise run on (and a later fork copies them mid-use)."""
    before = _ray_data_threads()
    ds = ray_local.data.range(4000, override_num_blocks=40).map_batches(
        lambda b: {"image": np.zeros((len(b["id"]), 4, 4, 3), np.uint8), "label": b["id"] % 3,
                   "epoch": np.zeros(len(b["id"]), np.int64)}, batch_size=None)
    stream = _streams({"train_p0": ds.iterator()}, ahead=False).take(0)
    next(stream)
    assert _ray_data_threads() - before, "the execution was expected to run on in this process"
    stream.close()
    # The executor's own thread ends a moment after close: the condition is polled, with a deadline.
    wait_for(lambda: not _ray_data_threads() - before, 60, "the closed stream's Ray Data threads to end",
             interval=0.05)


def test_a_source_whose_shutdown_fails_is_logged_and_does_not_replace_the_phases_own_error(caplog):
    def source():
        try:
            while True:
                yield {"image": np.zeros((2, 4, 4, 3), np.uint8), "label": np.zeros(2, np.int64)}
        finally:
            raise RuntimeError("the cluster went away during shutdown")

    stream = DevicePrefetcher(source(), torch.device("cpu"))
    next(stream)
    with caplog.at_level("WARNING", logger="lightray.train.prefetch"):
        stream.close()  # called from run_phase's finally: raising here would hide the error that ended the phase
    assert "the cluster went away during shutdown" in caplog.text


def test_the_run_opens_each_phase_stream_before_the_phase_and_the_next_one_at_its_last_epoch(finished_run):
    recs = records(finished_run)
    [unit] = [r for r in recs if r.get("unit") == "stream_ahead"]
    assert unit["enabled"], unit
    opened = {r["phase"]: r["stream_opened_at"] for r in recs if r.get("unit") == "progressive_resize"}
    schedule = json.loads((finished_run / "schedule.json").read_text())
    ends = {int(r["epoch"]): int(r["samples_seen"]) for r in recs if "val_top1" in r and "event" not in r}
    # The first phase while the model was built (at 0 samples); each later one at the start of the last epoch of
    # the phase before it, i.e. where the validation before that epoch left the run.
    expected = {0: 0}
    for k, ph in enumerate(schedule["phases"][:-1]):
        last_epoch = ph["end_epoch"] - 1
        expected[k + 1] = ends[last_epoch] if last_epoch > 0 else 0
    assert opened == expected, (opened, expected, NAME)
