"""Runs on s3:// for real: a local S3 API server (moto's ThreadedMotoServer), reached through pyarrow's
S3FileSystem with ``endpoint_override`` in the storage URI, not a mock of pyarrow."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lightray import storage
from lightray.train.state import list_checkpoints, validate_checkpoint
from tests.conftest import S3_ENV
from tests.faults import ROOT, driver, finish


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


@pytest.mark.slow
def test_a_run_on_s3_stops_and_resumes_from_its_s3_checkpoints(s3_storage, shared_cache, tmp_path):
    """Each driver runs on "another machine" (its own home, so its own local mirror of the run's logs): the
    run's records live in the bucket, the resumed run appends to their whole history there, and the report
    is rendered from the bucket."""
    name = f"s3resume-{os.getpid()}"
    env = {**S3_ENV, "HOME": str(tmp_path / "first-machine")}
    finish(driver(s3_storage, name, "--checkpoint.stop_after_steps=3", cache=shared_cache, env=env))
    run_dir = storage.join(s3_storage, name)
    saved = list_checkpoints(run_dir)
    assert [s for s, _ in saved] == [3 * 64], saved  # the stop checkpoint, on S3
    assert validate_checkpoint(saved[0][1])["samples_seen"] == 3 * 64
    assert storage.read_json(storage.join(run_dir, "summary.json"))["status"] == "finished"
    first = storage.read_jsonl(storage.join(run_dir, "metrics.jsonl"))  # the records, in the bucket
    assert max(r.get("samples_seen", 0) for r in first) == 3 * 64
    assert storage.list_dir(storage.join(run_dir, "tensorboard"))  # TensorBoard events too

    env["HOME"] = str(tmp_path / "second-machine")  # an empty mirror: the history comes from the bucket
    out = finish(driver(s3_storage, name, "--resume", cache=shared_cache, env=env))
    summary = json.loads(storage.read_bytes(storage.join(run_dir, "summary.json")))
    assert summary["status"] == "finished" and summary["epochs"] == 2, out[-3000:]
    assert summary["samples_seen"] == 512
    resume = storage.read_json(storage.join(run_dir, "resume.json"))
    assert resume["samples_seen"] == 3 * 64 and resume["checkpoint"].startswith("s3://")  # resumed from S3
    assert not storage.exists(storage.join(run_dir, "driver.lock"))  # released on the way out
    records = storage.read_jsonl(storage.join(run_dir, "metrics.jsonl"))
    assert records[:len(first)] == first and max(r.get("samples_seen", 0) for r in records) == 512

    report = subprocess.run([sys.executable, "app/run.py", "--report", run_dir], cwd=ROOT, capture_output=True,
                            text=True, env={**os.environ, **env}, timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    assert "## Events" in storage.read_text(storage.join(run_dir, "report", "report.md"))
