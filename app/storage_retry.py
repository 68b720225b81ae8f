"""An object-store filesystem that rides out a short outage: every call retried with backoff on a connection
error, for ``RETRY_S`` seconds in all, before the error is raised, and so is every byte of a transfer.

Why a wrapper and not pyarrow's own ``retry_strategy``: Ray Train pickles the run's filesystem to its
controller and workers, and an ``S3FileSystem`` pickles without its retry strategy, so the controller's
writes (``checkpoint_manager_snapshot.json``) would fail on the first refused connection and end the run. A
``PyFileSystem`` over this handler pickles whole (the handler and the inner filesystem's options), so every
process that writes the run gets the same patience.

Reads go in ranged requests of ``READ_CHUNK`` bytes; one that fails part-way is asked again from the byte
already delivered (the object reopened), so a restart in the middle of a shard costs one chunk, not the read.
Writes to S3 stream: each ``PART_BYTES`` goes up as one part of a multipart upload (boto3, since pyarrow's
stream cannot resume a part), each part retried, one part in flight while the next fills, so a writer holds
about two parts however big the object. The upload is completed at close, and aborted when a part fails past
the retry budget: the object then keeps its old content, never a half of the new. A write under one part is a
single PUT at close, retried. Other object stores (gs://, ...) still collect a write in memory and upload it at
close under the retry. Missing files, permissions, bad credentials and the like are answers, not outages: they
are raised at once.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs

log = logging.getLogger("lightray.storage")
RETRY_S = 120.0  # in all, per call: longer than a server restart, shorter than Ray's own give-up times
FIRST_WAIT_S = 0.5
MAX_WAIT_S = 10.0
# S3's parts must be 5 MiB or more (all but the last); 8 MiB is the AWS CLI's default, and a failed part or
# read costs at most this much again.
PART_BYTES = 8 << 20
READ_CHUNK = 8 << 20
MAX_PARTS = 10_000  # S3's limit per upload
T = TypeVar("T")
# OSErrors that are a real answer from the store, never worth a retry.
_ANSWERS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)
# What an outage looks like in the AWS SDK's and curl's messages (a refused or dropped connection, a time-out,
# throttling, a server error). Anything else (a bad key, a missing bucket, access denied) is an answer too: it
# is raised at once, not after two minutes of waiting.
_TRANSIENT = ("connect", "network", "timeout", "timed out", "reset", "unavailable", "slow_down", "throttl",
              "internal_failure", "internal error", "broken pipe")
# S3 error codes (boto3's ClientError) that mean "ask again later", whatever the HTTP status.
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                    "ServiceUnavailable", "RequestLimitExceeded"}
# pyarrow's S3 write metadata keys -> boto3's arguments (all that pyarrow's own S3 stream honours but Expires).
_METADATA_ARGS = {"ACL": "ACL", "Cache-Control": "CacheControl", "Content-Type": "ContentType",
                  "Content-Language": "ContentLanguage"}


class _Outage(OSError):
    """A boto3 error that is an outage (a dropped connection, a 5xx, throttling): always retried."""


def with_retry(what: str, fn: Callable[[], T], retry_s: float | None = None) -> T:
    """``fn()``, retried with doubling waits while it raises a connection-type OSError, up to ``retry_s``
    (``RETRY_S`` when None, read at call time so that a test or a caller can shorten it)."""
    budget = RETRY_S if retry_s is None else retry_s
    deadline, wait = time.monotonic() + budget, FIRST_WAIT_S
    while True:
        try:
            return fn()
        except _ANSWERS:
            raise
        except OSError as exc:
            transient = isinstance(exc, _Outage) or any(t in str(exc).lower() for t in _TRANSIENT)
            if not transient or time.monotonic() + wait > deadline:
                raise
            log.warning("storage: %s failed (%s); retrying in %.1f s", what, str(exc).splitlines()[0][:200], wait)
            time.sleep(wait)
            wait = min(MAX_WAIT_S, wait * 2)


# --- boto3, for what pyarrow's S3 filesystem does not expose -------------------------------------------------
def s3_client(options: Mapping[str, Any], max_attempts: int = 10) -> Any:
    """A boto3 S3 client for the store that pyarrow's ``S3FileSystem`` options name (``endpoint_override``,
    ``scheme``, ``region``, ``access_key``, ``secret_key``, ``session_token``: the keys of an s3:// URI's query
    string and of the filesystem's pickled options); keys left out come from the usual AWS chain. Standard
    retries, ``max_attempts`` calls in all."""
    import boto3
    from botocore.config import Config

    endpoint = options.get("endpoint_override") or None
    if endpoint and "://" not in endpoint:
        endpoint = f"{options.get('scheme') or 'https'}://{endpoint}"
    # pyarrow addresses buckets by path on a custom endpoint (MinIO, moto, ...); boto3 is told to do the same.
    s3_style = {"addressing_style": "path"} if endpoint else None
    return boto3.client("s3", endpoint_url=endpoint, region_name=options.get("region") or None,
                        aws_access_key_id=options.get("access_key") or None,
                        aws_secret_access_key=options.get("secret_key") or None,
                        aws_session_token=options.get("session_token") or None,
                        config=Config(retries={"max_attempts": max_attempts, "mode": "standard"}, s3=s3_style))


_CLIENT_KEYS = ("endpoint_override", "scheme", "region", "access_key", "secret_key", "session_token")


@functools.lru_cache(maxsize=8)
def _transfer_client(options: tuple[tuple[str, Any], ...]) -> Any:
    # One attempt per call: with_retry owns the patience (one budget, one log line per wait), where botocore's
    # own backoff would multiply it.
    return s3_client(dict(options), max_attempts=1)


def _client_for(fs: pafs.S3FileSystem) -> Any:
    # The filesystem's pickled options are the one public view of its endpoint, region and explicit keys.
    options = fs.__reduce__()[1][0]
    return _transfer_client(tuple((k, options.get(k)) for k in _CLIENT_KEYS))


def _boto(what: str, fn: Callable[[], T]) -> T:
    """``fn()`` (a boto3 call), its errors as the OSErrors the rest of storage raises: an outage as
    :class:`_Outage` (retried), a missing bucket, key or upload as FileNotFoundError, a refusal as
    PermissionError, anything else as OSError; each message names ``what``."""
    from botocore.exceptions import ClientError, ConnectionError, HTTPClientError, SSLError

    try:
        return fn()
    except SSLError as exc:  # a bad certificate does not heal in two minutes
        raise OSError(f"{what}: {exc}") from exc
    except (ConnectionError, HTTPClientError) as exc:
        raise _Outage(f"{what}: connection failed: {exc}") from exc
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if code in _TRANSIENT_CODES or status >= 500:
            raise _Outage(f"{what}: server unavailable: {exc}") from exc
        if code in ("NoSuchBucket", "NoSuchKey", "NoSuchUpload") or status == 404:
            raise FileNotFoundError(f"{what}: {exc}") from exc
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch") or status == 403:
            raise PermissionError(f"{what}: {exc}") from exc
        raise OSError(f"{what}: {exc}") from exc


# --- reading ---------------------------------------------------------------------------------------------
class _ResumingReader(io.RawIOBase):
    """A random-access read of one object whose every request is retried: a read that fails part-way
    reopens the object and goes on from the byte already delivered, so the caller gets the object's bytes
    exactly, or an error. Large reads go in ``READ_CHUNK`` requests, the most an outage can cost again."""

    def __init__(self, fs: pafs.FileSystem, path: str):
        self._fs, self._path, self._pos = fs, path, 0
        self._inner: pa.NativeFile | None = with_retry(f"open {path}", lambda: fs.open_input_file(path))
        self._size = self._inner.size()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def size(self) -> int:
        return self._size

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"{self._path}: cannot seek to byte {base + offset}")
        self._pos = base + offset
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._size, self._pos + size)
        chunks = []
        while self._pos < end:
            n = min(READ_CHUNK, end - self._pos)
            try:
                got = with_retry(f"read {self._path} at byte {self._pos}", lambda n=n: self._read_at(n))
            except _ANSWERS:
                raise
            except OSError as exc:
                raise OSError(f"{self._path}: reading stopped at byte {self._pos} of {self._size} (an outage "
                              f"is retried for up to {RETRY_S:.0f} s): {exc}") from exc
            if not got:  # the store said the object is shorter than it said at open
                raise OSError(f"{self._path}: ended at byte {self._pos}, expected {self._size} bytes")
            chunks.append(got)
            self._pos += len(got)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def readall(self) -> bytes:
        return self.read(-1)

    def _read_at(self, n: int) -> bytes:
        if self._inner is None:
            inner = self._fs.open_input_file(self._path)
            if inner.size() != self._size:  # replaced since: its bytes would not continue the ones delivered
                inner.close()
                raise OSError(f"{self._path}: is {inner.size()} bytes now, {self._size} when opened: it was "
                              "replaced while being read; read it again")
            self._inner = inner
        try:
            return self._inner.read_at(n, self._pos)
        except OSError:
            # A broken connection can leave the handle unusable: the next try opens the object afresh.
            self._drop()
            raise

    def _drop(self) -> None:
        inner, self._inner = self._inner, None
        if inner is not None:
            try:
                inner.close()
            except OSError:
                pass

    def close(self) -> None:
        self._drop()
        super().close()


# --- writing ---------------------------------------------------------------------------------------------
def _put_whole(fs: pafs.FileSystem, path: str, data: bytes, metadata: Any) -> None:
    """One retried upload of ``data`` through ``fs`` (a single PUT on S3 with delayed open)."""

    def upload() -> None:
        with fs.open_output_stream(path, metadata=metadata) as out:
            out.write(data)

    with_retry(f"write {path}", upload)


class _UploadOnClose(io.RawIOBase):
    """The write side for object stores other than S3: bytes collect in memory and go up in one retried call
    at close (no resumable upload there that pyarrow exposes)."""

    def __init__(self, fs: pafs.FileSystem, path: str, metadata: Any):
        self._fs, self._path, self._metadata, self._buf = fs, path, metadata, io.BytesIO()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self._buf.write(data)

    def close(self) -> None:
        if self.closed:
            return
        try:
            _put_whole(self._fs, self._path, self._buf.getvalue(), self._metadata)
        finally:
            super().close()


class _PartWriter(io.RawIOBase):
    """The write side on S3: parts of a multipart upload, each retried, one uploading while the next fills
    (about two parts in memory); completed at close, aborted when a part fails past the retry budget. A write
    that ends under one part is one PUT at close, as pyarrow would do it."""

    def __init__(self, fs: pafs.S3FileSystem, path: str, metadata: Any):
        self._fs, self._path, self._metadata = fs, path, metadata
        self._bucket, _, self._key = path.partition("/")
        self._buf = bytearray()
        self._parts: list[dict[str, Any]] = []  # {"PartNumber", "ETag"} of each part uploaded, in order
        self._upload_id: str | None = None
        self._pending: tuple[Future[dict[str, Any]], int] | None = None  # the part uploading, and its size
        self._pool: ThreadPoolExecutor | None = None
        self._client: Any = None
        self._failed = False

    @property
    def buffered_bytes(self) -> int:
        """Bytes of the object this writer may hold now (an upper bound): the part filling, and the part sent
        last, until the next one waits for it to finish."""
        return len(self._buf) + (self._pending[1] if self._pending is not None else 0)

    def writable(self) -> bool:
        return True

    def _part_bytes(self) -> int:
        # Parts grow by a step every 1000 so that S3's 10,000 parts reach 430 GiB, not 78.
        return PART_BYTES * (1 + len(self._parts) // 1000)

    def write(self, data: Any) -> int:
        if self._failed:
            raise OSError(f"{self._path}: this write already failed; nothing was written there")
        view = memoryview(data).cast("B")
        size = view.nbytes
        while len(view):
            room = self._part_bytes() - len(self._buf)
            self._buf += view[:room]
            view = view[room:]
            if len(self._buf) >= self._part_bytes():
                self._guarded(self._send_part)
        return size

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._failed:
                # Already raised to the writer, with its cause; raising again here (a ``with`` block's exit)
                # would hide that cause behind a vaguer message.
                return
            if self._upload_id is None:
                data = bytes(self._buf)
                self._guarded(lambda: _put_whole(self._fs, self._path, data, self._metadata))
            else:
                self._guarded(self._finish)
        finally:
            self._buf = bytearray()
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
            super().close()

    def _guarded(self, step: Callable[[], None]) -> None:
        """``step()``; on an error the upload is aborted (the object keeps its old content) and the error
        raised, naming the path, what had gone up and the budget it outlived."""
        try:
            step()
        except BaseException as exc:
            self._failed = True
            self._abort()
            if isinstance(exc, OSError) and not isinstance(exc, _ANSWERS):
                raise OSError(f"{self._path}: write failed after retrying for up to {RETRY_S:.0f} s "
                              f"({len(self._parts)} part(s) of {PART_BYTES >> 20} MiB had gone up; the upload "
                              f"was abandoned, so the path keeps its previous content, if any): {exc}") from exc
            raise

    def _send_part(self) -> None:
        part, self._buf = self._buf, bytearray()
        self._wait_pending()  # one part in flight at most: memory stays at about two parts
        if self._upload_id is None:
            self._upload_id = self._call("start multipart upload", lambda c: c.create_multipart_upload(
                Bucket=self._bucket, Key=self._key, **_metadata_args(self._metadata))["UploadId"])
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightray-s3-part")
        number = len(self._parts) + 1
        if number > MAX_PARTS:
            raise OSError(f"{self._path}: more than {MAX_PARTS} parts; S3 allows no more per object")
        assert self._pool is not None
        self._pending = (self._pool.submit(self._upload_part, number, part), len(part))

    def _upload_part(self, number: int, body: bytearray) -> dict[str, Any]:
        # Uploading a part number again replaces it: a retry after a lost answer is harmless.
        got = self._call(f"upload part {number} of", lambda c: c.upload_part(
            Bucket=self._bucket, Key=self._key, UploadId=self._upload_id, PartNumber=number, Body=body))
        return {"PartNumber": number, "ETag": got["ETag"]}

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self._parts.append(pending[0].result())

    def _finish(self) -> None:
        if self._buf:
            self._send_part()  # the last part may be under 5 MiB
        self._wait_pending()
        tries = 0

        def complete(c: Any) -> None:
            nonlocal tries
            tries += 1
            try:
                c.complete_multipart_upload(Bucket=self._bucket, Key=self._key, UploadId=self._upload_id,
                                            MultipartUpload={"Parts": self._parts})
            except Exception as exc:
                # A completion whose answer was lost in an outage: asked again, S3 may no longer know the
                # upload. The object is there if its ETag is the one these parts make.
                if tries > 1 and "NoSuchUpload" in str(exc) and self._etag_now(c) == self._expected_etag():
                    return
                raise

        self._call("complete multipart upload of", complete)
        self._upload_id = None

    def _expected_etag(self) -> str:
        digests = b"".join(bytes.fromhex(p["ETag"].strip('"')) for p in self._parts)
        return f'"{hashlib.md5(digests).hexdigest()}-{len(self._parts)}"'

    def _etag_now(self, client: Any) -> str | None:
        try:
            return client.head_object(Bucket=self._bucket, Key=self._key)["ETag"]
        except Exception:
            return None

    def _abort(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        upload_id, self._upload_id = self._upload_id, None
        if upload_id is None:
            return
        try:  # once: the store is likely still down, and S3 never shows an unfinished upload at the path
            _boto(f"abort upload to {self._path}", lambda: self._s3().abort_multipart_upload(
                Bucket=self._bucket, Key=self._key, UploadId=upload_id))
        except OSError as exc:
            log.warning("storage: could not abort multipart upload %s to %s (%s); its parts stay on the store "
                        "until a lifecycle rule for incomplete uploads removes them", upload_id, self._path,
                        str(exc).splitlines()[0][:200])

    def _s3(self) -> Any:
        if self._client is None:
            self._client = _client_for(self._fs)
        return self._client

    def _call(self, what: str, fn: Callable[[Any], T]) -> T:
        """``fn(client)``, retried through outages within the budget."""
        label = f"{what} {self._path}"
        return with_retry(label, lambda: _boto(label, lambda: fn(self._s3())))


def _metadata_args(metadata: Any) -> dict[str, str]:
    """boto3's arguments for the pyarrow write metadata (a KeyValueMetadata of bytes, or a dict) it knows."""
    items = metadata.to_dict() if hasattr(metadata, "to_dict") else dict(metadata or {})
    text = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in items.items()}
    return {_METADATA_ARGS[k]: v for k, v in text.items() if k in _METADATA_ARGS}


class RetryingHandler(pafs.FileSystemHandler):
    """Delegates to ``fs`` (an S3FileSystem, ...) with :func:`with_retry` around each call, and around each
    request of a read or a write (see the module docstring)."""

    def __init__(self, fs: pafs.FileSystem):
        self.fs = fs

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RetryingHandler) and self.fs.equals(other.fs)

    def __hash__(self) -> int:
        return hash(self.fs.type_name)

    def _do(self, what: str, path: str, fn: Callable[[], T]) -> T:
        return with_retry(f"{what} {path}", fn)

    def get_type_name(self) -> str:
        return f"retrying-{self.fs.type_name}"

    def normalize_path(self, path: str) -> str:
        return self.fs.normalize_path(path)

    def equals(self, other: Any) -> bool:
        return self == other

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self._do("stat", ",".join(paths[:3]), lambda: self.fs.get_file_info(paths))

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self._do("list", selector.base_dir, lambda: self.fs.get_file_info(selector))

    def create_dir(self, path: str, recursive: bool) -> None:
        self._do("mkdir", path, lambda: self.fs.create_dir(path, recursive=recursive))

    def delete_dir(self, path: str) -> None:
        self._do("rmdir", path, lambda: self.fs.delete_dir(path))

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self._do("empty", path, lambda: self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok))

    def delete_root_dir_contents(self) -> None:
        self._do("empty", "/", lambda: self.fs.delete_dir_contents("/", accept_root_dir=True))

    def delete_file(self, path: str) -> None:
        self._do("delete", path, lambda: self.fs.delete_file(path))

    def move(self, src: str, dest: str) -> None:
        self._do("move", f"{src} -> {dest}", lambda: self.fs.move(src, dest))

    def copy_file(self, src: str, dest: str) -> None:
        self._do("copy", f"{src} -> {dest}", lambda: self.fs.copy_file(src, dest))

    # On an object store a stream and a random-access file are the same ranged GETs behind one HEAD, so both
    # are the resuming reader.
    def open_input_stream(self, path: str) -> pa.NativeFile:
        return pa.PythonFile(_ResumingReader(self.fs, path), mode="r")

    def open_input_file(self, path: str) -> pa.NativeFile:
        return pa.PythonFile(_ResumingReader(self.fs, path), mode="r")

    def open_writer(self, path: str, metadata: Any = None) -> io.RawIOBase:
        """The Python writer behind :meth:`open_output_stream` (streamed parts on S3, else one upload at
        close); ``buffered_bytes`` on S3's says how much of the object it holds."""
        if isinstance(self.fs, pafs.S3FileSystem):
            return _PartWriter(self.fs, path, metadata)
        return _UploadOnClose(self.fs, path, metadata)

    def open_output_stream(self, path: str, metadata: Any) -> pa.NativeFile:
        return pa.PythonFile(self.open_writer(path, metadata), mode="w")

    def open_append_stream(self, path: str, metadata: Any) -> pa.NativeFile:
        return self._do("open for append", path, lambda: self.fs.open_append_stream(path, metadata=metadata))


def retrying(fs: pafs.FileSystem) -> pafs.FileSystem:
    """``fs`` behind :class:`RetryingHandler` (a ``PyFileSystem``, picklable to Ray's processes)."""
    return pafs.PyFileSystem(RetryingHandler(fs))
