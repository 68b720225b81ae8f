"""A run's records in its storage: ``metrics.jsonl``, TensorBoard events and ``startup.json`` copied from
the driver's local mirror to ``<storage>/<name>/`` on a short period and at the end.

Object stores cannot append, and a worker must never wait on one, so the run log keeps appending to a
local file on the driver's node (``~/lightray_runs/<name>``, app/report/runlog.py). Without this copy the
records of a run on s3:// would die with the head node; with it, anyone can follow a run with
``tensorboard --logdir s3://.../<name>/tensorboard``, report it with ``--report s3://.../<name>`` and resume
it from another machine (``pull`` brings the history back into a fresh mirror first).

A file is uploaded whole when its size or modification time changed since its last upload. A JSON-lines
file is cut at its last newline first: the run log may be half-way through a line when the copy is taken.
"""

from __future__ import annotations

import os
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

from lightray import storage

# What a run's mirror holds that the storage should hold too (summary.json is written to both directly;
# checkpoints go to the storage through Ray Train). Folders are copied with everything in them.
RECORDS = ("metrics.jsonl", "startup.json", "tensorboard")
REPORT_SKIP = ("checkpoint_", "tensorboard", ".")  # not needed to render a report: never downloaded for one


def _local_files(local_dir: str, names: tuple[str, ...] = RECORDS) -> Iterator[tuple[str, pathlib.Path]]:
    """(path relative to the run folder, local path) of each record file present in the mirror."""
    root = pathlib.Path(local_dir)
    for name in names:
        p = root / name
        if p.is_file():
            yield name, p
        elif p.is_dir():
            for f in sorted(p.rglob("*")):
                if f.is_file() and not f.name.startswith("."):
                    yield f.relative_to(root).as_posix(), f


def _content(path: pathlib.Path) -> bytes:
    data = path.read_bytes()
    if path.suffix == ".jsonl" and data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]  # a line still being written goes up with the next copy
    return data


class RecordSync:
    """Copies a run's records from its local mirror to its storage folder: ``sync()`` once, or ``start()`` a
    thread that syncs every ``every_s`` and ``stop()`` it with a last sync. A no-op when the two folders are
    the same (a run on a local or shared file system writes its records in place)."""

    def __init__(self, local_dir: str, run_dir: str, every_s: float = 15.0):
        self.local_dir, self.run_dir, self.every_s = local_dir, run_dir, every_s
        self.active = storage.normalise(local_dir) != storage.normalise(run_dir)
        self._sent: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) last uploaded
        self._lock = threading.Lock()  # the thread's sync and the last one never interleave
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0
        self.last_error: str | None = None

    def sync(self) -> int:
        """Upload every record file changed since its last upload; returns how many went up."""
        if not self.active:
            return 0
        sent = 0
        with self._lock:
            for rel, path in _local_files(self.local_dir):
                st = path.stat()
                key = (st.st_size, st.st_mtime_ns)
                if self._sent.get(rel) == key:
                    continue
                storage.write_bytes(storage.join(self.run_dir, *rel.split("/")), _content(path))
                self._sent[rel] = key
                sent += 1
        return sent

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.sync()
            except Exception as exc:  # storage down for a while: the next period (or the last sync) retries
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"

    def start(self) -> RecordSync:
        if self.active and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="lightray-record-sync", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> int:
        """Stop the thread and copy what changed since its last pass (raises if the storage is unreachable)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self.sync()


def pull(run_dir: str, local_dir: str) -> list[str]:
    """Bring a run's records from its storage into a local mirror that holds less of them (a resume on
    another machine, or after the mirror was lost), so that the resumed run appends to its whole history.
    A mirror file at least as large as the stored one is newer (written after the last sync) and kept.
    Returns the relative paths copied."""
    if storage.normalise(local_dir) == storage.normalise(run_dir):
        return []
    fs, inner = storage.resolve_fs(run_dir)
    copied = []
    for name in RECORDS:
        for rel, size in _stored_files(fs, inner, name):
            target = pathlib.Path(local_dir, *rel.split("/"))
            if target.is_file() and target.stat().st_size >= size:
                continue
            storage.write_bytes(str(target), storage.read_bytes(storage.join(run_dir, *rel.split("/"))))
            copied.append(rel)
    return copied


def _stored_files(fs: Any, inner: str, name: str) -> Iterator[tuple[str, int]]:
    """(relative path, size) of the stored file ``name``, or of every file under the stored folder ``name``."""
    base = inner.rstrip("/")
    info = storage.file_info(f"{base}/{name}", fs=fs)
    if info.type == storage.FileType.File:
        yield name, int(info.size or 0)
    elif info.type == storage.FileType.Directory:
        for i in storage.list_dir(f"{base}/{name}", detail=True, recursive=True, fs=fs):
            if i.type == storage.FileType.File:
                yield i.path[len(base) + 1:], int(i.size or 0)


def fetch_for_report(uri: str, local_dir: str) -> str:
    """Copy what a report reads from a run or experiment folder on object storage (records, summaries,
    configs; not checkpoints or TensorBoard events) into ``local_dir``; returns ``local_dir``."""
    fs, inner = storage.resolve_fs(uri)
    base = inner.rstrip("/")
    infos = storage.list_dir(base, detail=True, recursive=True, fs=fs)
    if not infos:
        raise FileNotFoundError(f"--report {uri}: nothing stored there; expected a run folder "
                                "<storage>/<name>/ or a Tune experiment folder")
    for i in infos:
        rel = i.path[len(base) + 1:]
        if i.type != storage.FileType.File or any(part.startswith(REPORT_SKIP) for part in rel.split("/")):
            continue
        storage.write_bytes(os.path.join(local_dir, *rel.split("/")), storage.read_bytes(i.path, fs=fs))
    return local_dir


def push_folder(local_dir: str, uri: str) -> list[str]:
    """Upload every file under ``local_dir`` to the folder ``uri``; returns the URIs written."""
    out = []
    root = pathlib.Path(local_dir)
    for f in sorted(root.rglob("*")):
        if f.is_file():
            target = storage.join(uri, *f.relative_to(root).parts)
            storage.write_bytes(target, f.read_bytes())
            out.append(target)
    return out


def mirror_dir(run_dir: str, name: str) -> str:
    """The driver's local mirror of a run folder: the folder itself when it is on a file system."""
    return run_dir if not storage.is_uri(run_dir) else str(pathlib.Path.home() / "lightray_runs" / name)
