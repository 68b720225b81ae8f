"""A soak fault on s3:// storage: the S3 endpoint (a relay in front of moto's ThreadedMotoServer, a real S3 API
over HTTP) goes down for a few seconds mid-run, every open connection cut and every new one turned away, and
comes back on the same address with the same buckets; the run waits or retries (a checkpoint write that fails
in the outage restarts the worker group from an earlier checkpoint) and then finishes, having trained every
planned sample. The relay counts the connections it turned away: the outage must have met the run's requests."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import struct
import threading
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


def _close(sock: socket.socket, reset: bool = False) -> None:
    """Close a relayed connection, waking a relay thread blocked reading it; ``reset``: with an RST, as a
    vanished server drops it, not an orderly close."""
    try:
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RD if reset else socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class _Endpoint:
    """The S3 address the run knows: a TCP relay to the moto server on ``target``. ``set_down(True)`` resets every
    connection open through it; while down, each new connection is reset at once and its time kept in
    ``turned_away`` (a stopped server's refused connect cannot be counted; this one can)."""

    def __init__(self, port: int, target: int):
        self.target, self.turned_away = target, []
        self._down, self._lock = False, threading.Lock()
        self._pairs: dict[tuple, int] = {}  # open connection (client, upstream) -> directions ended
        self._server = socket.create_server(("127.0.0.1", port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            upstream = None
            if not self._down:
                try:
                    upstream = socket.create_connection(("127.0.0.1", self.target))
                except OSError:
                    pass
            pair = (client, upstream)
            with self._lock:  # checked again: the outage may have begun while connecting upstream
                relayed = upstream is not None and not self._down
                if relayed:
                    self._pairs[pair] = 0
                elif self._down:
                    self.turned_away.append(time.time())
            if not relayed:
                for s in pair:
                    if s is not None:
                        _close(s, reset=True)
                continue
            for src, dst in (pair, pair[::-1]):
                threading.Thread(target=self._pump, args=(src, dst, pair), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, pair: tuple) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)  # an orderly end passed on: the other way may still carry a reply
            clean = True
        except OSError:
            clean = False  # reset by one side, or cut by the outage
        with self._lock:
            if pair not in self._pairs:
                return  # cut by the outage, or closed already
            self._pairs[pair] += 1
            if clean and self._pairs[pair] < 2:
                return
            del self._pairs[pair]
        for s in pair:
            _close(s)

    def set_down(self, down: bool) -> None:
        with self._lock:
            self._down = down
            cut = list(self._pairs) if down else []
            if down:
                self._pairs.clear()
        for pair in cut:
            for s in pair:
                _close(s, reset=True)

    def close(self) -> None:
        self._server.close()
        self.set_down(True)


def test_run_on_s3_goes_on_after_its_s3_endpoint_is_down_for_a_few_seconds(monkeypatch, tmp_path, shared_cache):
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    port, moto_port = _free_port(), _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=moto_port, verbose=False)
    server.start()
    endpoint = _Endpoint(port, moto_port)
    proc, deadline = None, time.time() + 270  # within the 300 s per test, teardown left over
    try:
        import pyarrow.fs as pafs

        pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1",
                          allow_bucket_creation=True).create_dir("lightray-runs")
        uri = f"s3://lightray-runs/runs?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
        name = f"s3-outage-{os.getpid()}"
        run_dir = storage.join(uri, name)
        proc = driver(uri, name, *long_run(4)[:-1], cache=shared_cache, env=S3_ENV)
        wait_for(lambda: list_checkpoints(run_dir), deadline - time.time(), "the first checkpoint on S3", proc,
                 interval=1.0)
        stopped_at = time.time()
        endpoint.set_down(True)  # the S3 endpoint goes away: no request gets an answer
        time.sleep(OUTAGE_S)  # the outage's length: the fault itself, not a wait for anything
        back_at = time.time()
        endpoint.set_down(False)  # back on the same address, moto's buckets as they were
        out = finish(proc, timeout=max(1.0, deadline - time.time()))
        summary = json.loads(storage.read_bytes(storage.join(run_dir, "summary.json")))
    finally:
        if proc is not None and proc.poll() is None:
            kill_group(proc)
        endpoint.close()
        server.stop()
    assert summary["status"] == "finished", out[-4000:]
    # The run asked S3 for something while it was down (and, having finished, asked again after): an outage
    # that met none of its requests would test nothing.
    assert endpoint.turned_away, f"no S3 request between {stopped_at:.1f} and {back_at:.1f}:\n{out[-3000:]}"
    print(f"s3 outage: {len(endpoint.turned_away)} connections turned away")
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
