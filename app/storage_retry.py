"""An object-store filesystem that rides out a short outage: every call retried with backoff on a connection
error, for ``RETRY_S`` seconds in all, before the error is raised.

Why a wrapper and not pyarrow's own ``retry_strategy``: Ray Train pickles the run's filesystem to its
controller and workers, and an ``S3FileSystem`` pickles without its retry strategy, so the controller's
writes (``checkpoint_manager_snapshot.json``) would fail on the first refused connection and end the run. A
``PyFileSystem`` over this handler pickles whole (the handler and the inner filesystem's options), so every
process that writes the run gets the same patience.

Writes are buffered in memory and uploaded at close under the retry (a stream that broke half-way cannot be
resumed); reads retry the open. Missing files, permissions, bad credentials and the like are answers, not
outages: they are raised at once.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs

log = logging.getLogger("lightray.storage")
RETRY_S = 120.0  # in all, per call: longer than a server restart, shorter than Ray's own give-up times
FIRST_WAIT_S = 0.5
MAX_WAIT_S = 10.0
T = TypeVar("T")
# OSErrors that are a real answer from the store, never worth a retry.
_ANSWERS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)
# What an outage looks like in the AWS SDK's and curl's messages (a refused or dropped connection, a time-out,
# throttling, a server error). Anything else (a bad key, a missing bucket, access denied) is an answer too: it
# is raised at once, not after two minutes of waiting.
_TRANSIENT = ("connect", "network", "timeout", "timed out", "reset", "unavailable", "slow_down", "throttl",
              "internal_failure", "internal error", "broken pipe")


def with_retry(what: str, fn: Callable[[], T], retry_s: float = RETRY_S) -> T:
    """``fn()``, retried with doubling waits while it raises a connection-type OSError, up to ``retry_s``."""
    deadline, wait = time.monotonic() + retry_s, FIRST_WAIT_S
    while True:
        try:
            return fn()
        except _ANSWERS:
            raise
        except OSError as exc:
            if not any(t in str(exc).lower() for t in _TRANSIENT) or time.monotonic() + wait > deadline:
                raise
            log.warning("storage: %s failed (%s); retrying in %.1f s", what, str(exc).splitlines()[0][:200], wait)
            time.sleep(wait)
            wait = min(MAX_WAIT_S, wait * 2)


class _UploadOnClose(io.RawIOBase):
    """The write side of an output stream: bytes collect in memory and go up in one retried call at close."""

    def __init__(self, fs: pafs.FileSystem, path: str, metadata: Any):
        self._fs, self._path, self._metadata, self._buf = fs, path, metadata, io.BytesIO()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self._buf.write(data)

    def close(self) -> None:
        if self.closed:
            return
        data = self._buf.getvalue()

        def upload() -> None:
            with self._fs.open_output_stream(self._path, metadata=self._metadata) as out:
                out.write(data)

        try:
            with_retry(f"write {self._path}", upload)
        finally:
            super().close()


class RetryingHandler(pafs.FileSystemHandler):
    """Delegates to ``fs`` (an S3FileSystem, ...) with :func:`with_retry` around each call."""

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

    def open_input_stream(self, path: str) -> pa.NativeFile:
        return self._do("open", path, lambda: self.fs.open_input_stream(path))

    def open_input_file(self, path: str) -> pa.NativeFile:
        return self._do("open", path, lambda: self.fs.open_input_file(path))

    def open_output_stream(self, path: str, metadata: Any) -> pa.NativeFile:
        return pa.PythonFile(_UploadOnClose(self.fs, path, metadata), mode="w")

    def open_append_stream(self, path: str, metadata: Any) -> pa.NativeFile:
        return self._do("open for append", path, lambda: self.fs.open_append_stream(path, metadata=metadata))


def retrying(fs: pafs.FileSystem) -> pafs.FileSystem:
    """``fs`` behind :class:`RetryingHandler` (a ``PyFileSystem``, picklable to Ray's processes)."""
    return pafs.PyFileSystem(RetryingHandler(fs))
