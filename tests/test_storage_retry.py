"""Object-store calls ride out a short outage: a real S3 API server (moto) stopped and started again on the
same address while a write and a read wait; missing files are answers, raised at once."""

from __future__ import annotations

import logging
import pickle
import threading
import time

import pytest

from lightray import storage
from lightray.storage_retry import with_retry
from tests.conftest import S3_ENV
from tests.ports import free_port

OUTAGE_S = 8.0


@pytest.fixture
def restartable_s3(monkeypatch):
    """(uri, stop, start): a moto server on a fixed port that a test can stop and start again."""
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    port = free_port()
    box = {"server": moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)}
    box["server"].start()

    def start() -> None:
        box["server"] = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        box["server"].start()

    try:
        import pyarrow.fs as pafs

        pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1",
                          allow_bucket_creation=True).create_dir("retry-test")
        yield (f"s3://retry-test/run?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1",
               lambda: box["server"].stop(), start)
    finally:
        box["server"].stop()


def test_a_write_and_a_read_wait_out_a_server_restart(restartable_s3, caplog):
    uri, stop, start = restartable_s3
    storage.write_bytes(storage.join(uri, "before.json"), b"{}")
    stop()
    # Longer than the AWS SDK's own few quick retries: the server comes back while ours are waiting.
    threading.Timer(OUTAGE_S, start).start()
    t0 = time.monotonic()
    logger = logging.getLogger("lightray.storage")
    logger.addHandler(caplog.handler)  # the app's loggers may not propagate to the root
    try:
        storage.write_bytes(storage.join(uri, "during.json"), b'{"a": 1}')
        assert storage.read_json(storage.join(uri, "during.json")) == {"a": 1}
    finally:
        logger.removeHandler(caplog.handler)
    assert time.monotonic() - t0 >= OUTAGE_S - 1  # it did wait for the restart
    assert "retrying in" in caplog.text
    assert storage.read_json(storage.join(uri, "before.json")) == {}  # nothing written earlier was lost


def test_a_missing_file_is_raised_at_once_not_retried(restartable_s3):
    uri, _stop, _start = restartable_s3
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(storage.join(uri, "absent.json"))
    assert time.monotonic() - t0 < 5.0


def test_the_filesystem_pickles_with_its_retries_for_rays_processes(restartable_s3):
    uri, stop, start = restartable_s3
    fs, inner = storage.resolve_fs(uri)
    again = pickle.loads(pickle.dumps(fs))  # what Ray Train sends to its controller and workers
    assert again.type_name == fs.type_name == "py::retrying-s3"
    stop()
    threading.Timer(2.0, start).start()
    with again.open_output_stream(f"{inner}/from-a-copy.txt") as out:
        out.write(b"kept")
    assert storage.read_bytes(storage.join(uri, "from-a-copy.txt")) == b"kept"


def test_only_outage_errors_are_retried():
    calls: list[int] = []

    def denied() -> None:
        calls.append(1)
        raise OSError("AWS Error ACCESS_DENIED during PutObject operation: Access Denied")

    with pytest.raises(OSError, match="ACCESS_DENIED"):
        with_retry("write x", denied, retry_s=5.0)
    assert len(calls) == 1  # an answer, raised at once

    def refused_then_ok() -> str:
        calls.append(2)
        if calls.count(2) < 3:
            raise OSError("AWS Error NETWORK_CONNECTION during PutObject operation: Could not connect")
        return "ok"

    assert with_retry("write y", refused_then_ok, retry_s=30.0) == "ok" and calls.count(2) == 3
