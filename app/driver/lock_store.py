"""Compare-and-swap on one small file, local or on S3: the primitive the run lock needs.

``create`` writes only if no file is there, ``replace`` and ``delete`` act only if the file is still the one
this caller last saw (its tag). On S3 these are conditional requests (``If-None-Match: *`` and ``If-Match:
<ETag>``), which S3 evaluates atomically, so of two drivers racing, exactly one create succeeds however slow
their requests are. On a local (or NFS) folder: a hard link that fails if the name exists, and
``replace``/``delete`` under an ``flock`` of a guard file beside it. Other object stores (gs://, ...) have no
conditional request that pyarrow exposes: there the store writes, waits and reads back, which two slow writes
can both pass, and says so once.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import pathlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

from lightray import storage

log = logging.getLogger("lightray")


class LockStore:
    """One file's content and tag (a version: the S3 ETag, or the content's hash)."""

    def read(self) -> tuple[bytes, str] | None:
        raise NotImplementedError

    def create(self, data: bytes) -> str | None:
        """Write ``data`` if there is no file; its tag, or None when a file was there."""
        raise NotImplementedError

    def replace(self, data: bytes, tag: str) -> str | None:
        """Write ``data`` if the file still has ``tag``; the new tag, or None when it changed (or is gone)."""
        raise NotImplementedError

    def delete(self, tag: str) -> bool:
        """Remove the file if it still has ``tag``."""
        raise NotImplementedError

    def keeps_conditions(self, data: bytes) -> bool:
        """Whether a create over the file (which holds ``data``) is refused, as it must be; asked once a lock is
        taken. Only an object store can get this wrong, by ignoring the condition."""
        return True


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class LocalLockStore(LockStore):
    def __init__(self, path: str):
        self.path = pathlib.Path(path)
        self.guard = self.path.with_name(f".{self.path.name}.guard")

    @contextmanager
    def _guarded(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.guard, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def read(self) -> tuple[bytes, str] | None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        return data, _digest(data)

    def _write(self, data: bytes) -> str:
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, self.path)  # readers see the old file or the new one, never half of one
        return _digest(data)

    def create(self, data: bytes) -> str | None:
        # A hard link to a finished file appears whole or not at all, and fails if the name exists: an atomic
        # create-if-absent that no reader can catch half-written.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.new{os.getpid()}")
        tmp.write_bytes(data)
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            return None
        finally:
            tmp.unlink()
        return _digest(data)

    def replace(self, data: bytes, tag: str) -> str | None:
        with self._guarded():
            now = self.read()
            return self._write(data) if now is not None and now[1] == tag else None

    def delete(self, tag: str) -> bool:
        with self._guarded():
            now = self.read()
            if now is None or now[1] != tag:
                return False
            self.path.unlink()
            return True


class S3LockStore(LockStore):
    """Conditional requests through boto3, which pyarrow's S3 filesystem does not expose. The endpoint, scheme,
    region and any keys come from the URI's query string, as pyarrow reads them; else from the usual chain."""

    def __init__(self, uri: str):
        self.client, self.bucket, self.key = storage.s3_client_for(uri)

    def _refused(self, exc: Exception) -> bool:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
        return code in ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "404", "412")

    def read(self) -> tuple[bytes, str] | None:
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except self.client.exceptions.NoSuchKey:
            return None
        return got["Body"].read(), got["ETag"]

    def _put(self, data: bytes, **cond: str) -> str | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=data, **cond)["ETag"]
        except ClientError as exc:
            if self._refused(exc):
                return None
            raise

    def create(self, data: bytes) -> str | None:
        return self._put(data, IfNoneMatch="*")

    def replace(self, data: bytes, tag: str) -> str | None:
        return self._put(data, IfMatch=tag)

    def keeps_conditions(self, data: bytes) -> bool:
        # An S3-compatible store that ignores If-None-Match accepts this second create; it writes the same bytes,
        # so the lock and its ETag stay as they were.
        return self.create(data) is None

    def delete(self, tag: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=tag)
            return True
        except ClientError as exc:
            if self._refused(exc):
                return False
            raise


class ReadBackLockStore(LockStore):
    """Write, wait ``settle_s``, read back: the best an object store without conditional writes allows."""

    warned: set[str] = set()

    def __init__(self, path: str, settle_s: float = 0.2):
        self.path, self.settle_s = path, settle_s
        scheme = urlsplit(path).scheme
        if scheme not in self.warned:
            self.warned.add(scheme)
            log.warning("run lock on %s://: no conditional write there, so two drivers started at the same "
                        "instant could both take a run; start one driver per run", scheme)

    def read(self) -> tuple[bytes, str] | None:
        try:
            data = storage.read_bytes(self.path)
        except FileNotFoundError:
            return None
        return data, _digest(data)

    def _write_checked(self, data: bytes) -> str | None:
        storage.write_bytes(self.path, data)
        time.sleep(self.settle_s)
        now = self.read()
        return now[1] if now is not None and now[0] == data else None

    def create(self, data: bytes) -> str | None:
        return None if self.read() is not None else self._write_checked(data)

    def replace(self, data: bytes, tag: str) -> str | None:
        now = self.read()
        return self._write_checked(data) if now is not None and now[1] == tag else None

    def delete(self, tag: str) -> bool:
        now = self.read()
        if now is None or now[1] != tag:
            return False
        storage.remove(self.path)
        return True


def lock_store(path: str, settle_s: float = 0.2) -> LockStore:
    """The store for a lock file at ``path``: a local path, ``file://``, ``s3://``, or another URI (there
    ``settle_s`` is the read-back pause)."""
    if not storage.is_uri(path) or path.startswith("file://"):
        return LocalLockStore(storage.normalise(path))
    if path.startswith("s3://"):
        return S3LockStore(path)
    return ReadBackLockStore(path, settle_s)
