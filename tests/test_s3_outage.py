"""A soak fault on s3:// storage: the S3 server (moto's ThreadedMotoServer, a real S3 API over HTTP) stops
for a few seconds mid-run and comes back on the same address with the same buckets; the run waits or
retries (a checkpoint write that fails in the outage restarts the worker group from an earlier checkpoint)
and then finishes, having trained every planned sample."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import time

import pytest

from lightray import storage
from lightray.train.state import list_checkpoints
from tests.conftest import S3_ENV
from tests.faults import driver, finish, kill_group, long_run, wait_for

pytestmark = pytest.mark.slow
OUTAGE_S = 8.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_run_on_s3_goes_on_after_the_s3_server_is_stopped_for_a_few_seconds(monkeypatch, tmp_path, shared_cache):
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    proc = None
    try:
        import pyarrow.fs as pafs

        pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1",
                          allow_bucket_creation=True).create_dir("lightray-runs")
        uri = f"s3://lightray-runs/runs?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
        name = f"s3-outage-{os.getpid()}"
        run_dir = storage.join(uri, name)
        proc = driver(uri, name, *long_run(4)[:-1], cache=shared_cache, env=S3_ENV)
        wait_for(lambda: list_checkpoints(run_dir), 600, "the first checkpoint on S3", proc, interval=1.0)
        stopped_at = time.time()
        server.stop()  # the S3 endpoint goes away: connections refused
        time.sleep(OUTAGE_S)
        back_at = time.time()
        # Back on the same address; moto keeps its buckets in this process, as a real S3 keeps them.
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        out = finish(proc, timeout=900)
        summary = json.loads(storage.read_bytes(storage.join(run_dir, "summary.json")))
    finally:
        if proc is not None and proc.poll() is None:
            kill_group(proc)
        server.stop()
    assert summary["status"] == "finished", out[-4000:]
    # The outage fell mid-run: steps were trained while S3 was down or after it came back, short of the end.
    local = pathlib.Path.home() / "lightray_runs" / name / "metrics.jsonl"
    train = [json.loads(line) for line in local.read_text().splitlines() if '"event"' not in line]
    train = [r for r in train if "val_top1" not in r]
    assert any(r["time"] > stopped_at for r in train), "the run had ended before the outage"
    assert min(r["samples_seen"] for r in train if r["time"] > stopped_at) < summary["samples_seen"]
    print(f"s3 outage: steps during it {sum(stopped_at < r['time'] < back_at for r in train)}, after it "
          f"{sum(r['time'] >= back_at for r in train)}")
    # Every planned sample trained (long_run(4): 2 epochs of 512 at batch 64, 2 of 16 steps at batch 32).
    assert summary["samples_seen"] == 2 * 512 + 2 * 16 * 32, out[-4000:]
    print(f"s3 outage: restarts={summary['restarts']}, lost_work={summary['lost_work']}")
