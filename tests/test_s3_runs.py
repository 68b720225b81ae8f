"""Runs on s3:// for real: a local S3 API server (moto's ThreadedMotoServer), reached through pyarrow's
S3FileSystem with ``endpoint_override`` in the storage URI, not a mock of pyarrow."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from lightray import storage
from lightray.driver.run_lock import LOCK_NAME
from lightray.train.state import list_checkpoints, validate_checkpoint
from tests.conftest import S3_ENV
from tests.faults import ROOT, assert_same_model, driver, final_state, finish, kill_group
from tests.finished_run import finished_run_args


def test_join_keeps_the_query_string_of_a_uri_at_its_end():
    base = "s3://b/runs?endpoint_override=127.0.0.1:9000&scheme=http"
    assert storage.join(base, "run", "checkpoint_1/") == \
        "s3://b/runs/run/checkpoint_1?endpoint_override=127.0.0.1:9000&scheme=http"
    assert storage.join("/tmp/x?y", "z") == "/tmp/x?y/z"  # a local name may hold "?"


def test_resume_without_a_name_finds_the_newest_run_on_s3(s3_storage):
    import time

    from lightray.config import load_config
    from lightray.driver.runner import resolve_run

    cfg = load_config("smoke", {"storage": s3_storage})
    with pytest.raises(FileNotFoundError, match="no run found in storage s3://lightray-runs/runs"):
        resolve_run(cfg, resume=True)
    storage.write_bytes(storage.join(s3_storage, "cache", "manifest.json"), b"{}")  # the shard cache: no run
    for name in ("older", "newer"):
        storage.write_bytes(storage.join(s3_storage, name, "config.yaml"), b"recipe: smoke\n")
        storage.write_bytes(storage.join(s3_storage, name, "checkpoint_000000000064", "meta.json"), b"{}")
        time.sleep(1.1)  # S3 keeps LastModified to the second
    cfg = load_config("smoke", {"storage": s3_storage})
    resolve_run(cfg, resume=True)
    assert cfg.name == "newer" and cfg.storage == s3_storage


def test_resume_without_a_name_finds_the_newest_run_in_a_folder_as_on_s3(tmp_path):
    import time

    from lightray.config import load_config
    from lightray.driver.runner import resolve_run

    (tmp_path / "cache").mkdir()  # the shard cache: no run
    for name in ("older", "newer"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text("recipe: smoke\n")
        time.sleep(0.05)
    cfg = load_config("smoke", {"storage": str(tmp_path)})
    resolve_run(cfg, resume=True)
    assert cfg.name == "newer"


STOP = 6  # of the finished run's 12 steps: mid-way through epoch 1, after its 4 steps of 64 and 2 of 32
AT_STOP = 4 * 64 + 2 * 32


@pytest.mark.slow
def test_a_run_on_s3_stopped_and_resumed_on_another_machine_ends_on_the_uninterrupted_parameters(
        s3_storage, finished_run, shared_cache, tmp_path):
    """Two drivers started at once, one refused by the lock; stop mid-epoch, resume: the exact continuation of
    the uninterrupted run (the session's finished run, whose options the drivers take), with every file of the run
    in the bucket. Each stage runs on "another machine" (its own home, so its own local mirror of the run's logs):
    the resumed run appends to the records' whole history in the bucket, and the report is rendered from it."""
    name = f"s3resume-{os.getpid()}"
    args = finished_run_args(finished_run.parent.parent)
    env = {**S3_ENV, "HOME": str(tmp_path / "first-machine")}
    # Two drivers of the run started at the same instant: the lock's conditional create on S3 lets exactly one
    # hold it; the other exits 2 naming the holder (host and pid), and the holder trains on.
    procs = [driver(s3_storage, name, *args, f"--checkpoint.stop_after_steps={STOP}", cache=shared_cache, env=env)
             for _ in range(2)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_group(p)
    assert sorted(p.returncode for p in procs) == [0, 2], [(p.returncode, o[-2000:]) for p, o in zip(procs, outs)]
    (winner,) = [p for p in procs if p.returncode == 0]
    (refused,) = [o for p, o in zip(procs, outs) if p.returncode == 2]
    line = refused.strip().splitlines()[-1]
    assert line.startswith("lightray: error:") and "already being run by another driver" in line, line
    assert f"pid {winner.pid}" in line and f"host {socket.gethostname()}" in line, line
    run_dir = storage.join(s3_storage, name)
    assert not storage.exists(storage.join(run_dir, LOCK_NAME))  # released on the way out
    saved = list_checkpoints(run_dir)
    assert [s for s, _ in saved] == [AT_STOP, 4 * 64], saved  # the stop's and epoch 0's checkpoints, on S3
    assert validate_checkpoint(saved[0][1])["samples_seen"] == AT_STOP
    first_summary = storage.read_json(storage.join(run_dir, "summary.json"))
    assert first_summary["status"] == "finished" and first_summary["samples_seen"] == AT_STOP
    first = storage.read_jsonl(storage.join(run_dir, "metrics.jsonl"))  # the records, in the bucket
    assert max(r.get("samples_seen", 0) for r in first) == AT_STOP
    assert storage.list_dir(storage.join(run_dir, "tensorboard"))  # TensorBoard events too

    env["HOME"] = str(tmp_path / "second-machine")  # an empty mirror: the history comes from the bucket
    out = finish(driver(s3_storage, name, *args, "--resume", cache=shared_cache, env=env))
    summary = json.loads(storage.read_bytes(storage.join(run_dir, "summary.json")))
    assert summary["status"] == "finished" and summary["epochs"] == 2, out[-3000:]
    assert summary["samples_seen"] == 512
    resume = storage.read_json(storage.join(run_dir, "resume.json"))
    assert resume["samples_seen"] == AT_STOP and resume["checkpoint"].startswith("s3://")  # resumed from S3
    assert not storage.exists(storage.join(run_dir, LOCK_NAME))  # released again
    records = storage.read_jsonl(storage.join(run_dir, "metrics.jsonl"))
    assert records[:len(first)] == first and max(r.get("samples_seen", 0) for r in records) == 512
    starts = [r for r in records if r.get("event") in ("start", "restart")]
    assert starts[-1]["samples_seen"] == AT_STOP  # the second start picked up at the stop

    # The exact continuation: the uninterrupted run's counters and parameters.
    state, reference = final_state(run_dir), final_state(finished_run)
    assert state["counters"]["samples_seen"] == reference["counters"]["samples_seen"] == 512
    assert_same_model(state["model"], reference["model"])

    report = subprocess.run([sys.executable, "app/run.py", "--report", run_dir], cwd=ROOT, capture_output=True,
                            text=True, env={**os.environ, **env}, timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    assert "## Events" in storage.read_text(storage.join(run_dir, "report", "report.md"))
