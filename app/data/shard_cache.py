"""The read side of the multi-level shard cache: shared storage -> node-local disk -> object store.

Level 1, shared storage (the run's storage or s3://): the shards prepare wrote.
Level 2, node-local disk (``local_dir``, the instance's NVMe on a cluster): a task that needs a shard
copies it there the first time, checks its sha256 and renames it into place atomically, so concurrent
tasks on one node never read a half-copied file; later epochs and later runs on that node read the copy.
``data.local_cache_max_gb`` bounds the copies' disk use: the least recently used copies are evicted first
(a copy's mtime is its last use; every lookup refreshes it, and so does a read served from a process's open
shards, at most once per :data:`_TOUCH_EVERY_S`). When copies must go, those some process on the node has
memory-mapped are in use: they go last, and a mapped copy already unlinked still counts against the budget,
since its blocks stay on disk until the last map closes.
Level 3, the Ray object store: a tier whose *decoded* pixels fit ``data.memory_budget_mb`` is decoded
once at start (one task per shard, :func:`materialize`) into a :class:`DecodedShard` whose arrays live
in shared memory; map tasks ``ray.get`` it (zero-copy on the node that holds it) and skip both the
Parquet read and the JPEG decode for the rest of the run.

Each process keeps the last few opened shards, since consecutive plan positions hit the same shard.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import pathlib
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image
from pyarrow.fs import FileType

from lightray.data import augment
from lightray.storage import resolve_fs
from lightray.storage import sha256 as sha256_file

log = logging.getLogger(__name__)
_MAX_OPEN = 16
_OPEN: OrderedDict[str, Any] = OrderedDict()
# A read served from _OPEN refreshes its copy's recency at most this often: a utime per block would be a
# syscall per read, and eviction only needs use to within seconds.
_TOUCH_EVERY_S = 5.0
_TOUCHED: dict[str, float] = {}
# Per-process counters (the map tasks' levels; tests read them in-process).
STATS = {"copied": 0, "local_hits": 0, "evicted": 0, "memory_hits": 0, "parquet_reads": 0, "object_store_reads": 0}
COLUMNS = ["image", "label", "sample_id", "height", "width"]


def default_local_dir() -> str:
    return os.environ.get("LIGHTRAY_LOCAL_CACHE", "/tmp/lightray-cache")


def copy_path(local_dir: str, sha256: str) -> pathlib.Path:
    """Where the node-local copy of the shard with this content hash lives."""
    return pathlib.Path(local_dir) / sha256[:2] / f"{sha256}.parquet"


def local_copy(uri: str, sha256: str, local_dir: str, max_bytes: int = 0) -> str:
    """Path of a verified node-local copy of shard ``uri`` (content-addressed by its sha256).

    ``max_bytes`` > 0 is the disk budget of the copies under ``local_dir`` (``data.local_cache_max_gb``):
    room is made before a copy by evicting the least recently used ones (:func:`make_room`). Under a tight
    budget another process may evict the copy as soon as this returns; readers use :func:`open_table`,
    which holds the file open from before it becomes visible to evictors."""
    fd, path = _open_copy(uri, sha256, local_dir, max_bytes)
    os.close(fd)
    return path


def _open_copy(uri: str, sha256: str, local_dir: str, max_bytes: int) -> tuple[int, str]:
    """A read-only descriptor of the shard's node-local copy (made if missing) and its path.

    The descriptor is opened before any evictor can see the file (on the copy path: before the rename into
    place), so an eviction that follows only unlinks the name: on Linux the open file stays readable."""
    target = copy_path(local_dir, sha256)
    try:
        fd = os.open(target, os.O_RDONLY)
    except FileNotFoundError:
        pass
    else:
        _touch(target)
        STATS["local_hits"] += 1
        return fd, str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fs, path = resolve_fs(uri)
    if max_bytes > 0:
        info = fs.get_file_info(path)
        if info.type == FileType.NotFound:
            raise FileNotFoundError(f"shard {uri}: not found on shared storage; rerun prepare to rebuild it")
        make_room(local_dir, int(info.size or 0), max_bytes, label=uri)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    try:
        with fs.open_input_stream(path) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    except FileNotFoundError:
        tmp.unlink(missing_ok=True)
        raise FileNotFoundError(f"shard {uri}: not found on shared storage; rerun prepare to rebuild it") from None
    got = sha256_file(str(tmp))
    if got != sha256:
        tmp.unlink(missing_ok=True)
        raise OSError(f"shard {uri}: checksum {got[:12]} does not match the manifest's {sha256[:12]}; "
                      "rerun prepare to rebuild it")
    fd = os.open(tmp, os.O_RDONLY)
    os.replace(tmp, target)
    STATS["copied"] += 1
    if max_bytes > 0:
        # Other processes on the node may have copied at the same time, each having made room for its own
        # shard only: trim back to the budget, never evicting the copy this call is about to hand out.
        make_room(local_dir, 0, max_bytes, keep=target)
    return fd, str(target)


def _touch(path: pathlib.Path) -> bool:
    """Mark a copy as just used (its mtime is its recency); False when there is no copy (or it was evicted)."""
    try:
        os.utime(path)
        return True
    except FileNotFoundError:
        return False
    except PermissionError:  # a copy another user made: readable, but its recency is not ours to set
        return path.is_file()


def touch_used(local_dir: str, sha256: str) -> None:
    """A read of the shard from this process's open shards counts as a use of its node-local copy."""
    now = time.monotonic()
    if now - _TOUCHED.get(sha256, -_TOUCH_EVERY_S) >= _TOUCH_EVERY_S:
        _TOUCHED[sha256] = now
        _touch(copy_path(local_dir, sha256))


def mapped_copies(local_dir: str) -> tuple[set[str], int]:
    """(paths of copies under ``local_dir`` that a process on this node has memory-mapped, bytes still held
    by mapped copies that were already unlinked), from every readable ``/proc/<pid>/maps``."""
    root = os.path.realpath(local_dir) + os.sep
    live: set[str] = set()
    gone: dict[tuple[str, str], int] = {}  # (device, inode) -> mapped bytes
    for maps in pathlib.Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process ended, or is not ours to read
            continue
        if root not in text:
            continue
        for line in text.splitlines():
            parts = line.split(None, 5)
            if len(parts) < 6 or not parts[5].startswith(root):
                continue
            path = parts[5]
            if path.endswith(" (deleted)"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                key = (parts[3], parts[4])
                gone[key] = max(gone.get(key, 0), hi - lo)
            elif path.endswith(".parquet"):
                live.add(path)
    return live, sum(gone.values())


def cached_copies(local_dir: str) -> list[tuple[int, int, pathlib.Path]]:
    """(last use in ns, bytes, path) of every shard copy under ``local_dir``, least recently used first."""
    out = []
    for p in pathlib.Path(local_dir).glob("??/*.parquet"):
        try:
            st = p.stat()
        except FileNotFoundError:  # evicted by another process between the listing and the stat
            continue
        out.append((st.st_mtime_ns, st.st_size, p))
    return sorted(out)


@contextmanager
def _evict_lock(local_dir: str) -> Iterator[None]:
    """One evictor at a time per node-local folder: two processes making room at once would each evict for
    the other's shard too. Readers do not take it (an evicted file stays readable where it is mapped)."""
    pathlib.Path(local_dir).mkdir(parents=True, exist_ok=True)
    with open(pathlib.Path(local_dir) / ".evict.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def make_room(local_dir: str, need: int, max_bytes: int, keep: pathlib.Path | None = None,
              label: str = "") -> list[str]:
    """Evict least-recently-used copies under ``local_dir`` until ``need`` more bytes fit in ``max_bytes``;
    returns the evicted paths. Copies that a process on the node has mapped are in use and go last; mapped
    copies already unlinked count as used, since their blocks are freed only when the last map closes. A
    mapped copy is unlinked when nothing else is left to evict: on Linux its open and memory-mapped handles
    stay valid. A shard larger than the whole budget is still copied (a run cannot read it otherwise), with a
    warning."""
    evicted: list[str] = []
    with _evict_lock(local_dir):
        copies = cached_copies(local_dir)
        used = sum(size for _, size, _ in copies)
        if used + need > max_bytes:
            # Only when something must go: reading every process's maps costs tens of ms on a busy node.
            live, held = mapped_copies(local_dir)
            used += held
            copies.sort(key=lambda c: (os.path.realpath(c[2]) in live, c[0]))
        now = time.time_ns()
        for mtime, size, path in copies:
            if used + need <= max_bytes:
                break
            if keep is not None and path == keep:
                continue
            try:
                path.unlink()
            except FileNotFoundError:  # removed by hand, or by an evictor on another node sharing the folder
                pass
            used -= size
            evicted.append(str(path))
            log.info("node-local shard cache %s: evicted %s (%.1f MB, last used %.0f s ago) to stay within "
                     "data.local_cache_max_gb=%g", local_dir, path.name, size / 2**20, (now - mtime) / 1e9,
                     max_bytes / 2**30)
    STATS["evicted"] += len(evicted)
    if need > max_bytes:
        log.warning("node-local shard cache %s: shard %s is %.1f MB, larger than the whole budget "
                    "data.local_cache_max_gb=%g; copying it anyway", local_dir, label, need / 2**20,
                    max_bytes / 2**30)
    return evicted


def open_table(uri: str, sha256: str, local_dir: str, columns: list[str] | None = None,
               max_bytes: int = 0) -> pa.Table:
    """The shard's table, read (memory-mapped) from the node-local copy.

    The map is made from the descriptor :func:`_open_copy` holds, never by reopening the path, so an
    evictor in another process (a budget that holds fewer shards than the node reads at once) cannot pull
    the file away between the copy and the read."""
    fd, _ = _open_copy(uri, sha256, local_dir, max_bytes)
    try:
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)  # the map keeps its own reference to the file
    return pq.read_table(pa.BufferReader(pa.py_buffer(mapped)), columns=columns)


def read_columns(uri: str, columns: list[str]) -> pa.Table:
    """A few small columns straight from shared storage (no local copy): Parquet reads only those."""
    fs, path = resolve_fs(uri)
    return pq.read_table(path, columns=columns, filesystem=fs)


class ShardView:
    """Row access to one shard at one tier: labels, ids, sizes and each row's image as a PIL image."""

    labels: np.ndarray
    ids: np.ndarray
    heights: np.ndarray
    widths: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    def image(self, row: int) -> Image.Image:
        raise NotImplementedError

    def pixels(self, row: int) -> np.ndarray:
        return np.asarray(self.image(row))

    def square_rows(self, size: int) -> np.ndarray | None:
        """Every row as one (rows, size, size, 3) uint8 view, where every row is stored as ``size`` x ``size``
        pixels back to back (a raw or decoded shard of equal photos); None otherwise (JPEG rows, mixed sizes)."""
        return None


def square_view(flat: np.ndarray, offsets: np.ndarray, heights: np.ndarray, widths: np.ndarray,
                size: int) -> np.ndarray | None:
    """``flat`` (the rows' pixels back to back, at ``offsets``) as (rows, size, size, 3) without a copy, when every
    row is ``size`` x ``size`` and the rows follow one another; None otherwise."""
    n, row = len(heights), size * size * 3
    if n == 0 or not ((heights == size).all() and (widths == size).all()):
        return None
    start = int(offsets[0])
    if not np.array_equal(np.asarray(offsets[:n + 1], np.int64) - start, np.arange(n + 1, dtype=np.int64) * row):
        return None
    return flat[start:start + n * row].reshape(n, size, size, 3)


class ParquetShard(ShardView):
    """A shard read from its node-local Parquet copy: image bytes are sliced zero-copy from the column."""

    def __init__(self, table: pa.Table, fmt: str):
        self.fmt = fmt
        self.labels = table.column("label").to_numpy().astype(np.int64)
        self.ids = table.column("sample_id").to_numpy().astype(np.int64)
        self.heights = table.column("height").to_numpy().astype(np.int64)
        self.widths = table.column("width").to_numpy().astype(np.int64)
        arr = table.column("image").combine_chunks()
        off_type = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
        self._offsets = np.frombuffer(arr.buffers()[1], dtype=off_type)[arr.offset:arr.offset + len(arr) + 1]
        self._data = memoryview(arr.buffers()[2]) if arr.buffers()[2] is not None else memoryview(b"")
        self._keep = arr  # the buffers above belong to it

    def image(self, row: int) -> Image.Image:
        data = self._data[int(self._offsets[row]):int(self._offsets[row + 1])]
        return augment.decode(data if self.fmt == "raw" else bytes(data), self.fmt,
                              int(self.heights[row]), int(self.widths[row]))

    def encoded(self, row: int) -> bytes:
        """The row's stored bytes as written by prepare (a JPEG, or raw pixels)."""
        return bytes(self._data[int(self._offsets[row]):int(self._offsets[row + 1])])

    def pixels(self, row: int) -> np.ndarray:
        if self.fmt != "raw":
            return np.asarray(self.image(row))
        # Raw rows are the pixels already: a read-only view into the memory-mapped column, no copy.
        data = self._data[int(self._offsets[row]):int(self._offsets[row + 1])]
        return np.frombuffer(data, dtype=np.uint8).reshape(int(self.heights[row]), int(self.widths[row]), 3)

    def square_rows(self, size: int) -> np.ndarray | None:
        if self.fmt != "raw":
            return None
        return square_view(np.frombuffer(self._data, dtype=np.uint8), self._offsets, self.heights, self.widths, size)


@dataclass
class DecodedShard(ShardView):
    """A shard's decoded pixels, all rows in one flat uint8 buffer: what the object-store level holds."""

    pixels_flat: np.ndarray  # uint8, every row's HWC pixels back to back
    offsets: np.ndarray  # int64, len(rows) + 1
    heights: np.ndarray
    widths: np.ndarray
    labels: np.ndarray
    ids: np.ndarray

    def pixels(self, row: int) -> np.ndarray:
        a, b = int(self.offsets[row]), int(self.offsets[row + 1])
        return self.pixels_flat[a:b].reshape(int(self.heights[row]), int(self.widths[row]), 3)

    def image(self, row: int) -> Image.Image:
        return Image.fromarray(self.pixels(row))

    def square_rows(self, size: int) -> np.ndarray | None:
        return square_view(self.pixels_flat, self.offsets, self.heights, self.widths, size)

    @property
    def nbytes(self) -> int:
        return int(self.pixels_flat.nbytes)


def parquet_shard(uri: str, sha256: str, fmt: str, local_dir: str, max_bytes: int = 0) -> ParquetShard:
    key = f"pq:{sha256}"
    view = _OPEN.get(key)
    if view is not None:
        _OPEN.move_to_end(key)
        STATS["memory_hits"] += 1
        if max_bytes > 0:  # recency matters only where a budget evicts
            touch_used(local_dir, sha256)
        return view
    view = ParquetShard(open_table(uri, sha256, local_dir, COLUMNS, max_bytes), fmt)
    STATS["parquet_reads"] += 1
    _remember(key, view)
    return view


def object_store_shard(ref: Any) -> DecodedShard:
    import ray

    key = f"ref:{ref.hex()}"
    view = _OPEN.get(key)
    if view is not None:
        _OPEN.move_to_end(key)
        return view
    view = ray.get(ref)  # zero-copy: the arrays point into the node's shared-memory object store
    STATS["object_store_reads"] += 1
    _remember(key, view)
    return view


def _remember(key: str, view: Any) -> None:
    _OPEN[key] = view
    if len(_OPEN) > _MAX_OPEN:
        _OPEN.popitem(last=False)


def decode_shard(uri: str, sha256: str, fmt: str, local_dir: str, max_bytes: int = 0) -> DecodedShard:
    """Every row of a shard decoded to uint8 HWC, in row order (same pixels the Parquet path yields)."""
    view = ParquetShard(open_table(uri, sha256, local_dir, COLUMNS, max_bytes), fmt)
    parts = [np.ascontiguousarray(view.pixels(r)).reshape(-1) for r in range(len(view))]
    sizes = np.array([0] + [p.size for p in parts], dtype=np.int64)
    flat = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    return DecodedShard(flat, np.cumsum(sizes), view.heights, view.widths, view.labels, view.ids)


def decoded_bytes(uris: list[str]) -> int:
    """Exact size of a tier's decoded pixels, from the shards' height/width columns (read remotely)."""
    total = 0
    for uri in uris:
        t = read_columns(uri, ["height", "width"])
        total += int((t.column("height").to_numpy().astype(np.int64) * t.column("width").to_numpy() * 3).sum())
    return total


def materialize(uris: list[str], sha256s: list[str], fmt: str, local_dir: str, num_cpus: float = 0.5,
                pending: list | None = None, max_bytes: int = 0) -> list:
    """Decode every shard of a tier into the object store, one task per shard; returns the refs in shard
    order once all are ready (a bad shard fails here, at start, not in the middle of an epoch). The refs
    are owned by the caller (the run's driver): they live as long as it holds them.

    With ``pending`` (a list), it does not wait: the decode runs while the rest of the start-up does (the
    worker group starting), the small size refs are appended to ``pending`` for whoever must wait, and a
    reader of a shard not decoded yet waits for that one shard."""
    import ray

    task = ray.remote(num_cpus=num_cpus, max_retries=2, num_returns=2)(_decode_task)
    pairs = [task.remote(u, s, fmt, local_dir, max_bytes) for u, s in zip(uris, sha256s)]
    if pending is not None:
        pending.extend(size for _, size in pairs)
    else:
        ray.get([size for _, size in pairs])  # surfaces errors now without pulling the pixels to the driver
    return [ref for ref, _ in pairs]


def _decode_task(uri: str, sha256: str, fmt: str, local_dir: str, max_bytes: int = 0) -> tuple[DecodedShard, int]:
    shard = decode_shard(uri, sha256, fmt, local_dir, max_bytes)
    return shard, shard.nbytes
