"""Files on local disk or object stores (s3://, gs://, file://), through ``pyarrow.fs``: the one place that
reads, writes, lists and removes what a run keeps (checkpoints, manifests, shards, run logs, summaries,
reports).

Every function takes a local path or a URI. ``os.path.join`` would break a URI, so paths are joined
with ``join``. Functions that a hot loop calls many times also take ``fs=`` (from ``resolve_fs``): then
``path`` is the path inside that filesystem and no filesystem is built per call, which on S3 costs a
credential lookup.

Writes are atomic for readers: locally the bytes go to a hidden temp file in the same folder that is
then renamed over the target (a reader sees the old file or the whole new one, and an interrupted write
leaves the old one); on object stores one PUT (a multipart upload for files larger than one part), whose
object only appears once complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import uuid
from typing import Any, Literal, overload
from urllib.parse import parse_qs, urlsplit

import pyarrow.fs as pafs

from lightray.storage_retry import retrying, s3_client

FileInfo = pafs.FileInfo
FileType = pafs.FileType
TMP_MARK = ".tmp-"  # in the hidden temp names of writes in flight: ".<name>.tmp-<tag>"


class JsonlError(ValueError):
    """A JSON-lines file with a bad line before its last one; the message names the file and line."""


# --- where a path lives ----------------------------------------------------------------------------------
def is_uri(path: str) -> bool:
    return "://" in str(path)


def normalise(path: str) -> str:
    """The canonical spelling of a path: an absolute local path (``file://`` and ``~`` resolved), or the
    URI without a trailing slash."""
    path = str(path)
    if is_uri(path):
        if path.startswith("file://"):
            return str(pathlib.Path(path.removeprefix("file://")).resolve())
        return path.rstrip("/")
    return str(pathlib.Path(path).expanduser().resolve())


def resolve_fs(path: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a local path or any URI pyarrow understands.

    Raises ValueError (pyarrow's ArrowInvalid) or OSError for a URI pyarrow cannot open."""
    path = str(path)
    if is_uri(path):
        if path.startswith("s3://") and "allow_delayed_open" not in path:
            # Delayed open lets a write that fits in one part go up as a single PutObject at close, instead of
            # a multipart upload (three requests); larger writes still use multipart.
            path += ("&" if "?" in path else "?") + "allow_delayed_open=true"
        fs, inner = pafs.FileSystem.from_uri(path)
        # An object store may drop out for a few seconds (a restart, a network blip): calls retry rather than
        # end the run (app/storage_retry.py). Local paths and file:// URIs answer at once.
        if not isinstance(fs, pafs.LocalFileSystem):
            fs = retrying(fs)
        return fs, inner.rstrip("/") or inner
    return pafs.LocalFileSystem(), str(pathlib.Path(path).expanduser().resolve())


def s3_client_for(uri: str) -> tuple[Any, str, str]:
    """(boto3 S3 client, bucket, key) for an s3:// URI, for what pyarrow's filesystem does not expose
    (conditional writes). Endpoint, scheme, region and any keys come from the URI's query string, as pyarrow
    reads them; else from the usual AWS chain. Standard retries ride out a short outage."""
    parts = urlsplit(uri)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    return s3_client(query), parts.netloc, parts.path.lstrip("/")


def _at(path: str, fs: pafs.FileSystem | None) -> tuple[pafs.FileSystem, str]:
    return (fs, str(path)) if fs is not None else resolve_fs(path)


def join(base: str, *parts: str) -> str:
    """Join onto a local path or a URI with "/" (``os.path.join`` would break s3://). A URI's query string
    (``?endpoint_override=...``) stays at the end, where pyarrow reads it."""
    root, q, query = str(base).partition("?") if is_uri(str(base)) else (str(base), "", "")
    out = root.rstrip("/")
    for p in parts:
        out = f"{out}/{str(p).strip('/')}"
    return out + q + query


# --- reading ---------------------------------------------------------------------------------------------
def read_bytes(path: str, *, fs: pafs.FileSystem | None = None, offset: int = 0) -> bytes:
    """The file's bytes from ``offset`` to its end. Raises FileNotFoundError for a missing file."""
    fs, inner = _at(path, fs)
    if isinstance(fs, pafs.LocalFileSystem):
        with open(inner, "rb") as f:  # plain open is the cheapest syscall path for local disks
            if offset:
                f.seek(offset)
            return f.read()
    if offset:
        with fs.open_input_file(inner) as f:
            f.seek(offset)
            return f.read()
    # A stream avoids the extra metadata request a random-access file makes on S3.
    with fs.open_input_stream(inner) as f:
        return f.readall()


def read_text(path: str, *, fs: pafs.FileSystem | None = None, encoding: str = "utf-8",
              errors: str = "strict") -> str:
    return read_bytes(path, fs=fs).decode(encoding, errors)


def read_json(path: str, *, fs: pafs.FileSystem | None = None) -> Any:
    return json.loads(read_bytes(path, fs=fs))


def parse_jsonl(text: str, name: str = "<jsonl>") -> tuple[list[dict[str, Any]], list[str]]:
    """The records of a JSON-lines text, and notes about what was skipped.

    The last line of a file another process appends to may be cut short: if it does not parse it is
    skipped with a note. A bad line anywhere else, or a line that is not an object, raises JsonlError.
    """
    lines = text.splitlines()
    records: list[dict[str, Any]] = []
    notes: list[str] = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines):
                notes.append(f"{name}:{i}: truncated last line skipped (run stopped while writing?)")
                continue
            raise JsonlError(f"{name}:{i}: not a JSON object ({exc.msg}); got {line[:80]!r}") from None
        if not isinstance(rec, dict):
            raise JsonlError(f"{name}:{i}: expected a JSON object per line, got {type(rec).__name__}")
        records.append(rec)
    return records, notes


def read_jsonl(path: str, *, fs: pafs.FileSystem | None = None) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (``metrics.jsonl``); a last line cut short is skipped."""
    return parse_jsonl(read_text(path, fs=fs, errors="replace"), str(path))[0]


def sha256(path: str, *, fs: pafs.FileSystem | None = None) -> str:
    """Hex sha256 of a file, streamed (shards are too big to hold twice)."""
    fs, inner = _at(path, fs)
    h = hashlib.sha256()
    with fs.open_input_stream(inner) as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# --- writing ---------------------------------------------------------------------------------------------
def write_bytes(path: str, data: bytes, *, fs: pafs.FileSystem | None = None) -> None:
    """Write a whole file atomically (see the module docstring); creates a local parent folder."""
    fs, inner = _at(path, fs)
    if isinstance(fs, pafs.LocalFileSystem):
        parent, name = os.path.split(inner)
        os.makedirs(parent, exist_ok=True)
        # Hidden, and unique per call: two writers of one file never share a temp, and listings skip it.
        tmp = os.path.join(parent, f".{name}{TMP_MARK}{uuid.uuid4().hex[:12]}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, inner)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return
    with fs.open_output_stream(inner) as f:
        f.write(data)


def write_text(path: str, text: str, *, fs: pafs.FileSystem | None = None, encoding: str = "utf-8") -> None:
    write_bytes(path, text.encode(encoding), fs=fs)


def write_json(path: str, obj: Any, *, fs: pafs.FileSystem | None = None, indent: int | None = None,
               default: Any = None) -> None:
    write_bytes(path, json.dumps(obj, indent=indent, default=default).encode(), fs=fs)


def append_text(path: str, text: str) -> None:
    """Append to a local file (object stores cannot append: run logs are written on the driver's disk)."""
    fs, inner = resolve_fs(path)
    if not isinstance(fs, pafs.LocalFileSystem):
        raise OSError(f"{path}: appending needs a local file; object stores have no append")
    with open(inner, "a", encoding="utf-8") as f:
        f.write(text)


def drop_partial_last_line(path: str) -> None:
    """Cut a local JSON-lines file back to its last newline (a writer killed mid-line), so appends that
    follow start on a line of their own."""
    fs, inner = resolve_fs(path)
    if not isinstance(fs, pafs.LocalFileSystem) or not os.path.isfile(inner):
        return
    with open(inner, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def makedirs(path: str, *, fs: pafs.FileSystem | None = None) -> None:
    """Create a folder and its parents (a no-op on object stores without real folders)."""
    fs, inner = _at(path, fs)
    fs.create_dir(inner, recursive=True)


# --- listing and removing --------------------------------------------------------------------------------
def file_info(path: str, *, fs: pafs.FileSystem | None = None) -> FileInfo:
    fs, inner = _at(path, fs)
    return fs.get_file_info(inner)


def exists(path: str, *, fs: pafs.FileSystem | None = None) -> bool:
    return file_info(path, fs=fs).type != FileType.NotFound


def file_size(path: str, *, fs: pafs.FileSystem | None = None) -> int | None:
    """Size in bytes of a file, or None when there is none."""
    info = file_info(path, fs=fs)
    return int(info.size or 0) if info.type == FileType.File else None


@overload
def list_dir(path: str, *, detail: Literal[False] = ..., recursive: bool = ...,
             fs: pafs.FileSystem | None = ...) -> list[str]: ...
@overload
def list_dir(path: str, *, detail: Literal[True], recursive: bool = ...,
             fs: pafs.FileSystem | None = ...) -> list[FileInfo]: ...
def list_dir(path: str, *, detail: bool = False, recursive: bool = False,
             fs: pafs.FileSystem | None = None) -> list[str] | list[FileInfo]:
    """The entries of a folder, sorted: base names, or pyarrow FileInfo (type, size, mtime, full inner path)
    with ``detail``. A missing folder has no entries."""
    fs, inner = _at(path, fs)
    infos = sorted(fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True, recursive=recursive)),
                   key=lambda i: i.path)
    return infos if detail else [i.base_name for i in infos]


def remove(path: str, *, fs: pafs.FileSystem | None = None, missing_ok: bool = True) -> None:
    """Delete a file, or a folder with everything in it."""
    fs, inner = _at(path, fs)
    info = fs.get_file_info(inner)
    if info.type == FileType.NotFound:
        if missing_ok:
            return
        raise FileNotFoundError(f"{path}: no such file or folder")
    if info.type == FileType.Directory:
        fs.delete_dir(inner)
    else:
        fs.delete_file(inner)
