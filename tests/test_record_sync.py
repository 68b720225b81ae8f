"""A run on s3:// keeps its records in its storage (app/report/record_sync.py): metrics.jsonl and TensorBoard
copied from the driver's mirror on a period, pulled back into a fresh mirror on resume, and ``--report
s3://...`` rendered from the bucket and written back to it. On the local S3 server (moto), no mocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightray import storage
from lightray.report.record_sync import RecordSync, pull
from lightray.report.tensorboard_log import TBLogger
from tests.conftest import S3_ENV
from tests.test_report import REPO, T0, train_line, write_run


def _stored_lines(run_dir: str) -> list[dict]:
    path = storage.join(run_dir, "metrics.jsonl")
    return [json.loads(x) for x in storage.read_text(path).splitlines()] if storage.exists(path) else []


def test_records_reach_s3_on_the_period_without_a_half_written_line(s3_storage, tmp_path: Path) -> None:
    mirror, run_dir = tmp_path / "mirror", storage.join(s3_storage, "r1")
    mirror.mkdir()
    metrics = mirror / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "lo')  # the run log mid-line
    sync = RecordSync(str(mirror), run_dir, every_s=0.2).start()
    try:
        deadline = time.time() + 20
        while not _stored_lines(run_dir) and time.time() < deadline:
            time.sleep(0.1)
        assert _stored_lines(run_dir) == [{"step": 1}]  # the line being written waits for the next copy
        with metrics.open("a") as f:
            f.write('ss": 1.0}\n')
    finally:
        sync.stop()  # the last copy, at the end of the run
    assert _stored_lines(run_dir) == [{"step": 1}, {"step": 2, "loss": 1.0}]
    assert sync.sync() == 0  # nothing changed: nothing uploaded again


def test_a_run_on_a_file_system_writes_its_records_in_place(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    sync = RecordSync(str(tmp_path), str(tmp_path)).start()
    assert sync.stop() == 0 and sync._thread is None


def test_tensorboard_reads_the_events_from_the_bucket(s3_storage, tmp_path: Path) -> None:
    """``S3_ENDPOINT=... tensorboard --logdir s3://<storage>/<name>/tensorboard``: TensorBoard's own S3 reader
    (boto3; it reads S3_ENDPOINT when it is imported, so in a process of its own) finds the scalars that the
    run log wrote on the driver's disk."""
    mirror, run_dir = tmp_path / "mirror", storage.join(s3_storage, "tb-run")
    with TBLogger(str(mirror / "tensorboard")) as tb:
        for step in (5, 10):
            tb.scalars(train_line(step, T0 + step, val_top1=0.25), step=step * 256)
    assert RecordSync(str(mirror), run_dir).sync() == 1
    endpoint = s3_storage.split("endpoint_override=")[1].split("&")[0]
    read = ("import json\n"
            "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n"
            "acc = EventAccumulator('s3://lightray-runs/runs/tb-run/tensorboard').Reload()\n"
            "print(json.dumps({t: [[e.step, e.value] for e in acc.Scalars(t)] for t in ('val/top1', 'train/loss')}))")
    out = subprocess.run([sys.executable, "-c", read], env={**os.environ, **S3_ENV, "S3_ENDPOINT": f"http://{endpoint}"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    scalars = json.loads(out.stdout.strip().splitlines()[-1])
    assert [s for s, _ in scalars["val/top1"]] == [5 * 256, 10 * 256]
    assert scalars["train/loss"][-1][1] == pytest.approx(2.3 - 0.2)


def test_resume_on_another_machine_pulls_the_history_and_keeps_a_newer_mirror(s3_storage, tmp_path: Path) -> None:
    run_dir = storage.join(s3_storage, "r2")
    storage.write_bytes(storage.join(run_dir, "metrics.jsonl"), b'{"step": 1}\n{"step": 2}\n')
    storage.write_bytes(storage.join(run_dir, "tensorboard", "events.out.tfevents.1"), b"tb")
    fresh = tmp_path / "fresh"
    assert sorted(pull(run_dir, str(fresh))) == ["metrics.jsonl", "tensorboard/events.out.tfevents.1"]
    assert (fresh / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    newer = tmp_path / "newer"  # written after the last copy: more than the bucket holds
    newer.mkdir()
    (newer / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    assert pull(run_dir, str(newer)) == ["tensorboard/events.out.tfevents.1"]
    assert (newer / "metrics.jsonl").read_text().count("\n") == 3


def test_report_of_a_run_on_s3_is_written_back_beside_its_records(s3_storage, tmp_path: Path) -> None:
    local = write_run(tmp_path / "done", restarts_at=(40,))
    run_uri = storage.join(s3_storage, "done")
    for f in local.rglob("*"):
        if f.is_file():
            storage.write_bytes(storage.join(run_uri, *f.relative_to(local).parts), f.read_bytes())
    storage.write_bytes(storage.join(run_uri, "checkpoint_000000000064", "model.pt"), b"not for a report")
    env = {**os.environ, **S3_ENV}
    out = subprocess.run([sys.executable, str(REPO / "app" / "run.py"), "--report", run_uri], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    written = out.stdout.split()
    assert written[0] == storage.join(run_uri, "report", "report.md")
    md = storage.read_text(written[0])
    assert "restart" in md and "![Accuracy](accuracy.png)" in md
    assert storage.read_bytes(storage.join(run_uri, "report", "accuracy.png"))[:4] == b"\x89PNG"
    assert not (local / "report").exists()  # rendered in a temporary folder, not in some local copy


def test_report_of_an_empty_uri_names_it(s3_storage) -> None:
    from lightray.cli import write_reports

    uri = storage.join(s3_storage, "no-such-run")
    with pytest.raises(FileNotFoundError, match="no-such-run.*expected a run folder"):
        write_reports(uri)


def test_a_records_copy_that_fails_at_the_end_is_returned_after_every_helper_stopped(ray_local, tmp_path: Path,
                                                                                    caplog) -> None:
    """The run's end with its storage gone: the records' last copy raises. It used to raise out of the driver's
    ``finally``, where it replaced the run's own error and skipped summary.json; ``close_out`` stops every helper,
    returns the bill and the error, and says where the complete records are."""
    from lightray.driver.billing import NodeMeter
    from lightray.driver.cluster_loss import ClusterWatch
    from lightray.driver.runner import close_out

    local = tmp_path / "mirror"
    local.mkdir()
    (local / "metrics.jsonl").write_text(json.dumps(train_line(1, 0.5)) + "\n")
    blocked = tmp_path / "storage-is-a-file"
    blocked.write_text("")  # the run's folder would be inside a file: every copy into it fails
    records = RecordSync(str(local), str(blocked / "run")).start()
    meter = NodeMeter(str(tmp_path / "bill"), "local").start()
    watch = ClusterWatch(ray_local.get_runtime_context().gcs_address, lambda cause: None).start()
    billing, error = close_out(meter, watch, records, str(local))
    assert isinstance(error, OSError), error
    assert billing is not None and "attempts" in billing, billing
    assert watch._stop.is_set()  # the cluster watch was stopped although the meter came first
    assert f"the run's records are complete in {local}" in caplog.text
