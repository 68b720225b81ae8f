"""Node-local level of the shard cache: shards on shared storage are copied once per node and kept.

Shared storage (the run's storage or s3://) holds the shards; a Ray Data task that needs one copies it
to ``local_dir`` (the instance's NVMe on a cluster) the first time, checks its sha256 and renames it
into place atomically, so concurrent tasks on one node never read a half-copied file. Each process
also keeps the last few decoded Parquet tables, since consecutive plan positions hit the same shard.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
from collections import OrderedDict

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

log = logging.getLogger(__name__)
_TABLES: OrderedDict[str, pa.Table] = OrderedDict()
_MAX_TABLES = 6
STATS = {"copied": 0, "local_hits": 0, "memory_hits": 0}


def default_local_dir() -> str:
    return os.environ.get("LIGHTRAY_LOCAL_CACHE", "/tmp/lightray-cache")


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def local_copy(uri: str, sha256: str, local_dir: str) -> str:
    """Path of a verified node-local copy of shard ``uri`` (content-addressed by its sha256)."""
    target = pathlib.Path(local_dir) / sha256[:2] / f"{sha256}.parquet"
    if target.is_file():
        STATS["local_hits"] += 1
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    fs, path = pafs.FileSystem.from_uri(uri if not _is_local(uri) else pathlib.Path(uri.removeprefix("file://"))
                                        .resolve().as_uri())
    with fs.open_input_stream(path) as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 22):
            dst.write(chunk)
    got = sha256_file(str(tmp))
    if got != sha256:
        tmp.unlink(missing_ok=True)
        raise OSError(f"shard {uri}: checksum {got[:12]} does not match the manifest's {sha256[:12]}; "
                      "rerun prepare to rebuild it")
    os.replace(tmp, target)
    STATS["copied"] += 1
    return str(target)


def open_table(uri: str, sha256: str, local_dir: str, columns: list[str] | None = None) -> pa.Table:
    key = f"{sha256}:{','.join(columns or [])}"
    table = _TABLES.get(key)
    if table is not None:
        _TABLES.move_to_end(key)
        STATS["memory_hits"] += 1
        return table
    path = local_copy(uri, sha256, local_dir)
    table = pq.read_table(path, columns=columns, memory_map=True)
    _TABLES[key] = table
    if len(_TABLES) > _MAX_TABLES:
        _TABLES.popitem(last=False)
    return table
