"""Retries that cover the whole transfer, on a real S3 API server (moto) stopped and started again on the same
address: a large read resumes at the byte it had reached, a large write streams in parts and the part the
outage hit is sent again, a write whose outage outlasts the retry budget leaves the old object whole, and a
writer holds about two parts of an object, not the object."""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
import tracemalloc

import pyarrow.fs as pafs
import pytest

from lightray import storage, storage_retry
from tests.test_storage_retry import restartable_s3  # noqa: F401  (the fixture: (uri, stop, start) of a moto server)

MIB = 1 << 20
BUCKET = "retry-test"  # the restartable_s3 fixture's
OUTAGE_S = 2.0  # a server restart; the stop itself takes another 0.5 s


def _payload(mib: int, seed: int) -> bytes:
    # Random, so that a chunk delivered twice or skipped cannot go unnoticed; seeded, so a failure repeats.
    return random.Random(seed).randbytes(mib * MIB)


def _same(got: bytes, want: bytes, what: str) -> None:
    # Hashes and lengths, not a 32 MiB diff, in the failure message.
    assert (len(got), hashlib.sha256(got).hexdigest()) == (len(want), hashlib.sha256(want).hexdigest()), \
        f"{what}: expected the {len(want)} bytes written, got {len(got)} bytes with other content"


def _fs(uri: str, name: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, folder inside it) for a test's own folder under ``uri`` (moto keeps every test's objects in
    one process): the retrying filesystem ``storage.resolve_fs`` gives, over an S3 client that does not retry by
    itself. The AWS SDK's own quick retries (about 6 s in all for a filesystem from a URI, 0.6-2.5 s for one
    rebuilt from its pickle in Ray's processes, seen here) would otherwise ride out a short outage by luck, and
    the test would not show whether this layer does."""
    fs, inner = storage.resolve_fs(storage.join(uri, name))
    options = fs.handler.fs.__reduce__()[1][0]  # the inner S3FileSystem's own options, as it pickles them
    once = pafs.S3FileSystem(**options, retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))
    return storage_retry.retrying(once), inner


def _client(fs: pafs.FileSystem) -> tuple[object, str]:
    """A boto3 client for the store behind ``fs``, and the bucket, to set up and inspect objects directly."""
    options = fs.handler.fs.__reduce__()[1][0]
    uri = f"s3://{BUCKET}?endpoint_override={options['endpoint_override']}&scheme=http&region=us-east-1"
    return storage.s3_client_for(uri)[:2]


def _put(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """Store ``data`` with boto3: the object a read test reads exists whatever the code under test does."""
    client, bucket = _client(fs)
    client.put_object(Bucket=bucket, Key=path.partition("/")[2], Body=data)


def _uploads_in_progress(fs: pafs.FileSystem, path: str) -> int:
    client, bucket = _client(fs)
    return len(client.list_multipart_uploads(Bucket=bucket, Prefix=path.partition("/")[2]).get("Uploads", []))


def _read(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_file(path) as f:  # one read: ranged requests of READ_CHUNK
        return f.read()


@pytest.fixture
def retry_log(caplog):
    """The retry warnings of lightray's storage logger (which may not propagate to the root)."""
    logger = logging.getLogger("lightray.storage")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def _outage(stop, start) -> float:
    """Stop the server now and start it again ``OUTAGE_S`` later, from a thread; the time it stopped."""
    stop()
    threading.Timer(OUTAGE_S, start).start()
    return time.monotonic()


def test_a_large_stream_read_resumes_at_its_offset_across_a_server_restart(restartable_s3, retry_log):  # noqa: F811
    uri, stop, start = restartable_s3
    fs, base = _fs(uri, "stream-read")
    data = _payload(32, seed=1)
    _put(fs, f"{base}/big.bin", data)
    got = bytearray()
    with fs.open_input_stream(f"{base}/big.bin") as f:
        got += f.read(4 * MIB)
        stopped = _outage(stop, start)
        while chunk := f.read(3 * MIB):  # not a multiple of the first: the resume offset is not a round number
            got += chunk
    assert time.monotonic() - stopped >= OUTAGE_S - 0.2  # it waited the restart out, then went on
    _same(bytes(got), data, "a stream read across a restart")
    assert f"at byte {4 * MIB} failed" in retry_log.text and "retrying in" in retry_log.text


def test_a_random_access_read_resumes_at_its_offset_across_a_server_restart(restartable_s3, retry_log):  # noqa: F811
    # What Parquet reads through: reads at offsets, then the rest in one call of several chunks.
    uri, stop, start = restartable_s3
    fs, base = _fs(uri, "random-read")
    data = _payload(24, seed=5)
    _put(fs, f"{base}/big.bin", data)
    with fs.open_input_file(f"{base}/big.bin") as f:
        head = f.read_at(MIB, 5 * MIB + 7)
        _outage(stop, start)
        f.seek(5 * MIB + 7 + MIB)
        tail = f.read()
    _same(head + tail, data[5 * MIB + 7:], "a random-access read across a restart")
    assert f"at byte {6 * MIB + 7} failed" in retry_log.text


def test_a_large_write_streams_in_parts_and_survives_a_server_restart(restartable_s3, retry_log):  # noqa: F811
    uri, stop, start = restartable_s3
    fs, base = _fs(uri, "streamed-write")
    data = _payload(40, seed=2)  # five parts of 8 MiB
    with fs.open_output_stream(f"{base}/big.bin") as out:
        for off in range(0, len(data), 4 * MIB):
            out.write(data[off:off + 4 * MIB])
            if off + 4 * MIB == 2 * storage_retry.PART_BYTES:
                # Two parts written: the first has gone up already (the write streams, nothing waits for close),
                # and the outage falls on the parts still to come.
                assert _uploads_in_progress(fs, f"{base}/big.bin") == 1, "no upload under way after two parts"
                _outage(stop, start)
    _same(_read(fs, f"{base}/big.bin"), data, "a streamed write across a restart")
    # The part the outage fell on (the second, still going up as the server stopped, or a later one) was sent again.
    assert "upload part" in retry_log.text and "retrying in" in retry_log.text
    assert _uploads_in_progress(fs, f"{base}/big.bin") == 0  # completed, nothing left behind


def test_a_write_that_outlasts_the_retry_budget_leaves_the_old_object(restartable_s3, monkeypatch):  # noqa: F811
    uri, stop, start = restartable_s3
    fs, base = _fs(uri, "failed-write")
    monkeypatch.setattr(storage_retry, "RETRY_S", 3.0)
    storage.write_bytes(f"{base}/ckpt.bin", b"the previous checkpoint", fs=fs)
    data = _payload(24, seed=3)
    t0 = time.monotonic()
    with pytest.raises(OSError, match=r"ckpt\.bin: write failed after retrying for up to 3 s") as failed:
        with fs.open_output_stream(f"{base}/ckpt.bin") as out:
            out.write(data[:2 * storage_retry.PART_BYTES])
            stop()  # for good: the budget runs out
            out.write(data[2 * storage_retry.PART_BYTES:])
    assert time.monotonic() - t0 < 15, "gave up far later than its 3 s budget"
    assert "keeps its previous content" in str(failed.value)
    start()
    # Never half of the new object, nor a cut one: the old bytes, whole, and nothing else in the folder.
    assert storage.read_bytes(f"{base}/ckpt.bin", fs=fs) == b"the previous checkpoint"
    assert storage.list_dir(base, fs=fs) == ["ckpt.bin"]


def test_a_writer_holds_about_two_parts_not_the_object(restartable_s3):  # noqa: F811
    uri, _stop, _start = restartable_s3
    fs, base = _fs(uri, "bounded-write")
    part = storage_retry.PART_BYTES
    data = _payload(48, seed=4)  # six parts
    writer = fs.handler.open_writer(f"{base}/big.bin")  # what open_output_stream wraps, with its buffer size
    held, traced = 0, 0
    tracemalloc.start()
    try:
        for off in range(0, len(data), MIB):
            writer.write(data[off:off + MIB])
            held = max(held, writer.buffered_bytes)
            if off % (4 * MIB) == 3 * MIB:
                # What the writer's own code allocated and still holds (the server's copies are moto's, not its).
                snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, storage_retry.__file__)])
                traced = max(traced, sum(s.size for s in snap.statistics("filename")))
        writer.close()
    finally:
        tracemalloc.stop()
    assert held <= 2 * part, f"the writer held {held / MIB:.1f} MiB at once; expected at most two parts"
    assert held > part  # one part filling while the one before went up: the measure saw both
    assert traced <= 2 * part + MIB, f"{traced / MIB:.1f} MiB traced to the writer; expected at most two parts"
    _same(_read(fs, f"{base}/big.bin"), data, "a streamed write")
