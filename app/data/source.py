"""Source listing: an ImageFolder tree (``train/<class>/*.jpg``, ``val/<class>/*.jpg``) on any filesystem;
``detect_kind`` also recognises Parquet files and WebDataset tar shards (listed by app/data/sources.py).

The listing is the identity of the source: every file's relative path, size and modification time go
into the shard cache key, so a changed, added or removed image gives a new cache. It is sorted and
stable, so ``sample_id`` (an entry's index in its split) means the same file on every run and machine.
Each split is a columnar table (:class:`SplitTable`), not one Python object per file: a file costs the
bytes of its path plus 20 as Arrow columns, against about 350 bytes as a per-file object (measured at
160 k files), which for ImageNet's 1.28 M files is tens of MB rather than hundreds.
All checks happen here, on the driver, before any Ray worker starts: a bad tree fails in seconds with
a message naming the path, not minutes later inside a task.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from lightray import storage
from lightray.storage import is_uri, join

# torchvision's IMG_EXTENSIONS, compared case-insensitively (ImageNet has a few upper-case names).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# The folders that name a split in an ImageFolder tree: val/ or validation/ is the val split; test/ is the
# source's own test split, never trained on nor scored (a held-back test set stays held back).
SPLIT_FOLDERS = {"train": ("train",), "val": ("val", "validation")}
TEST_FOLDERS = ("test",)
LIST_THREADS = 32  # class folders listed at once (object-store listings are latency-bound)


class DataError(ValueError):
    """A problem with the input data or the shard cache; the message names the path and what was expected."""


@dataclass(frozen=True)
class SourceEntry:
    """One file of a split as a small Python object: made on demand (one shard's rows, a test), never held
    for a whole split."""

    path: str  # relative to the source root, "/"-separated: "train/n01440764/x.JPEG"
    size: int
    mtime_ns: int
    label: int


SPLIT_SCHEMA = pa.schema([("path", pa.string()), ("size", pa.int64()), ("mtime_ns", pa.int64()),
                          ("label", pa.int32())])
_ROW_BATCH = 1 << 13  # rows turned into Python objects (or hashed) at a time: small transients


class SplitTable:
    """The files of one split as columns (path, size, mtime_ns, label), sorted by path.

    Row i is sample ``i`` of the split. Iterating or indexing gives :class:`SourceEntry` objects, made a batch
    at a time, so code that walks a split stays simple while the split itself holds no per-file objects."""

    __slots__ = ("table",)

    def __init__(self, table: pa.Table):
        self.table = table.select(SPLIT_SCHEMA.names).cast(SPLIT_SCHEMA).combine_chunks()

    @classmethod
    def from_entries(cls, entries: list[SourceEntry]) -> SplitTable:
        return cls(pa.table({"path": [e.path for e in entries], "size": [e.size for e in entries],
                             "mtime_ns": [e.mtime_ns for e in entries], "label": [e.label for e in entries]},
                            schema=SPLIT_SCHEMA))

    def __len__(self) -> int:
        return self.table.num_rows

    def __iter__(self) -> Iterator[SourceEntry]:
        for lo in range(0, len(self), _ROW_BATCH):
            yield from self.rows(np.arange(lo, min(lo + _ROW_BATCH, len(self))))

    def __getitem__(self, i: int) -> SourceEntry:
        return self.rows(np.array([_index(i, len(self))]))[0]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SplitTable) and self.table.equals(other.table)

    __hash__ = None  # unhashable, like the list it replaces

    def __repr__(self) -> str:
        return f"SplitTable({len(self)} files)"

    def column(self, name: str) -> np.ndarray:
        """``size``, ``mtime_ns`` or ``label`` as a numpy array; ``path`` as an object array of str (per-file
        objects: for one shard's slice, not a whole split)."""
        return self.table.column(name).to_numpy()

    def take(self, indices: np.ndarray) -> SplitTable:
        """The rows at ``indices``, in that order."""
        return SplitTable(self.table.take(pa.array(np.asarray(indices, dtype=np.int64))))

    def rows(self, indices: np.ndarray) -> list[SourceEntry]:
        """The rows at ``indices`` as :class:`SourceEntry` objects (one shard's worth at a time)."""
        cols = self.table.take(pa.array(np.asarray(indices, dtype=np.int64))).to_pydict()
        return [SourceEntry(*r) for r in zip(cols["path"], cols["size"], cols["mtime_ns"], cols["label"])]

    def update_hash(self, h: hashlib._Hash, prefix: str) -> None:
        """Feed ``f"{prefix}\\0{path}\\0{size}\\0{mtime_ns}\\0{label}\\n"`` of every row to ``h``, in order: the
        bytes a per-row Python loop would feed, joined by Arrow a batch at a time."""
        for lo in range(0, len(self), _ROW_BATCH):
            t = self.table.slice(lo, _ROW_BATCH)
            cols = [t.column(c) if c == "path" else pc.cast(t.column(c), pa.string())
                    for c in ("path", "size", "mtime_ns", "label")]
            _update_lines(h, [prefix, *cols], "\0")


def _index(i: int, n: int) -> int:
    i = int(i)
    if not -n <= i < n:
        raise IndexError(f"index {i} out of range for a split of {n} files")
    return i % n


def _update_lines(h: hashlib._Hash, parts: list, sep: str) -> None:
    """h.update(sep.join(parts[r]) + "\\n") for every row r, without a Python string per row: the joined
    column's data buffer is exactly those bytes back to back."""
    line = pc.binary_join_element_wise(*parts, sep)
    line = pc.binary_join_element_wise(line, "\n", "")
    arr = line.combine_chunks() if isinstance(line, pa.ChunkedArray) else line
    if len(arr) == 0:
        return
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset:arr.offset + len(arr) + 1]
    h.update(memoryview(arr.buffers()[2])[int(offsets[0]):int(offsets[-1])])


@dataclass
class SourceListing:
    root: str  # the normalised source: an absolute local path or a URI (s3://bucket/prefix)
    classes: list[str]  # index = label
    splits: dict[str, SplitTable] = field(default_factory=dict)
    holdout: dict | None = None  # how val/ was drawn from train/ when the source has no val/ (see hold_out)
    # the folder of each split under the root: "train", "val" or "validation"; "" for a tree of class folders alone
    split_dirs: dict[str, str] = field(default_factory=lambda: {"train": "train", "val": "val"})

    def fingerprint(self) -> str:
        """sha256 over the root and every entry (path, size, mtime): the source half of the cache key. The
        bytes hashed are those of the original per-entry loop, so existing caches keep their keys."""
        h = hashlib.sha256()
        h.update(f"root\0{self.root}\nclasses\0{chr(0).join(self.classes)}\n".encode())
        if self.holdout is not None:
            h.update(f"holdout\0{self.holdout['val_fraction']!r}\0{self.holdout['seed']}\n".encode())
        for split in sorted(self.splits):
            self.splits[split].update_hash(h, split)
        return h.hexdigest()

    def num_files(self, split: str) -> int:
        return len(self.splits[split]) if split in self.splits else 0


def resolve_fs(root: str) -> tuple[pafs.FileSystem, str]:
    """``storage.resolve_fs``, with a URI pyarrow cannot open reported as a DataError naming it."""
    try:
        return storage.resolve_fs(root)
    except (ValueError, OSError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{root}: cannot open this URI ({exc}); expected a path or a URI such as "
                        "s3://bucket/prefix or file:///abs/path") from None


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".")


def _hidden(rel: str) -> bool:
    return any(part.startswith((".", "_")) for part in rel.split("/"))


def split_dirs(root: str, dirs: set[str]) -> dict[str, str]:
    """{split: its folder under ``root``} from the root's folder names ``dirs``: ``train/`` with ``val/`` or
    ``validation/`` beside it, or (no split folder at all) the root itself as the train split, its folders the
    classes, as torchvision's ImageFolder reads it. ``test/`` is never listed. DataError for val/ and
    validation/ together, or a val/ or test/ folder without train/."""
    vals = [d for d in SPLIT_FOLDERS["val"] if d in dirs]
    if len(vals) > 1:
        raise DataError(f"{join(root, vals[1])}: the source has both {vals[0]}/ and {vals[1]}/; expected one "
                        "validation split folder")
    if "train" in dirs:
        return {"train": "train", **({"val": vals[0]} if vals else {})}
    named = sorted(dirs & {*vals, *TEST_FOLDERS})
    if named:
        raise DataError(f"{join(root, 'train')}: missing; the source has {named[0]}/ but no train/ split folder; "
                        f"expected train/<class>/ beside it, or a folder holding class folders only "
                        f"(found {', '.join(sorted(dirs))})")
    return {"train": ""}


def list_imagefolder(root: str, val_fraction: float = 0.0, seed: int = 0) -> SourceListing:
    """List ``root/{train,val}/<class>/**/<image>`` (or ``validation/`` for ``val/``), or ``root/<class>/**/<image>``
    as the train split, sorted by relative path.

    Classes are the sorted folder names of the train split; the val split must use only those. Raises DataError
    for a missing root, no class folders, a split or class folder without images, or an unknown val class.
    ``val_fraction`` > 0 on a source without a val split holds out that fraction of each train class as the val
    split (:func:`hold_out`, seeded by ``seed``); with a val folder present it is a DataError (which split to score
    would be ambiguous). 0 lists a train-only source as it is. A ``test/`` folder is never read.
    """
    norm = storage.normalise(root)
    fs, base = resolve_fs(norm)
    try:
        info = fs.get_file_info(base)
    except OSError as exc:
        raise DataError(f"{root}: cannot read the source ({exc}); expected an ImageFolder tree") from None
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"{root}: no such path; expected an ImageFolder tree: one folder per class, or "
                        "train/<class>/ folders")
    if info.type != pafs.FileType.Directory:
        raise DataError(f"{root}: is a file; expected a directory of class folders, or of train/<class>/ folders")
    dirs = {i.base_name for i in storage.list_dir(base, detail=True, fs=fs)
            if i.type == pafs.FileType.Directory and not _hidden(i.base_name)}
    if not dirs:
        raise DataError(f"{root}: no folders; expected one folder per class (an ImageFolder tree), or "
                        "train/<class>/ folders")
    listing = SourceListing(root=norm, classes=[], split_dirs=split_dirs(norm, dirs))
    per_split: dict[str, dict[str, pa.Table]] = {}
    for split, folder in listing.split_dirs.items():
        classes = _list_split(fs, f"{base}/{folder}" if folder else base, folder)
        if not any(t.num_rows for t in classes.values()):
            raise DataError(f"{_join_parts(norm, folder)}: no images; expected class folders holding "
                            f"files with extensions {', '.join(IMAGE_EXTENSIONS)}")
        for name, files in sorted(classes.items()):
            if not files.num_rows:
                raise DataError(f"{_join_parts(norm, folder, name)}: class folder has no images; expected files "
                                f"with extensions {', '.join(IMAGE_EXTENSIONS)} (remove the folder or add images)")
        per_split[split] = classes

    listing.classes = sorted(per_split["train"])
    index = {name: i for i, name in enumerate(listing.classes)}
    for split, classes in per_split.items():
        unknown = sorted(set(classes) - set(index))
        if unknown:
            folder = listing.split_dirs[split]
            raise DataError(f"{join(norm, folder, unknown[0])}: class {unknown[0]!r} is not among the "
                            f"{len(index)} train classes; expected {folder}/ to use train/'s class folders")
        table = pa.concat_tables(
            [t.append_column("label", pa.array(np.full(t.num_rows, index[name], dtype=np.int32)))
             for name, t in classes.items()])
        # Arrow orders strings by their UTF-8 bytes, which is Python's code-point order: the sort of old.
        listing.splits[split] = SplitTable(table.take(pc.sort_indices(table, [("path", "ascending")])))
    if "val" in listing.splits and val_fraction > 0:
        folder = listing.split_dirs["val"]
        raise DataError(f"{join(norm, folder)}: the source has a {folder}/ split, so data.val_fraction={val_fraction} "
                        f"has nothing to do; expected data.val_fraction=0 (use {folder}/) or a source without it")
    if "val" not in listing.splits and val_fraction > 0:
        hold_out(listing, val_fraction, seed)
    return listing


def _join_parts(root: str, *parts: str) -> str:
    """``join`` that skips empty parts: the train split of a tree of class folders is the root itself."""
    return join(root, *[p for p in parts if p])


def _list_split(fs: pafs.FileSystem, split_dir: str, folder: str) -> dict[str, pa.Table]:
    """{class folder: table of (path relative to the root, size, mtime_ns)} of one split, the class folders
    listed in parallel: one recursive listing per class, ``LIST_THREADS`` at a time. On an object store a
    single recursive listing of the split is one paged request after another (1,000 keys a page: over a
    thousand round trips for ImageNet's train split); per class the pages of different classes overlap.
    Locally the threads overlap the directory reads. Each class becomes columns as soon as it is listed, so
    per-file Python objects exist for the classes in flight only. The order does not matter: the caller sorts."""
    top = storage.list_dir(split_dir, detail=True, fs=fs)
    names = [i.base_name for i in top if i.type == pafs.FileType.Directory and not _hidden(i.base_name)]

    def one(name: str) -> tuple[list[str], list[int], list[int]]:
        class_dir = f"{split_dir}/{name}"
        paths, sizes, mtimes = [], [], []
        for fi in storage.list_dir(class_dir, detail=True, recursive=True, fs=fs):
            rel = fi.path[len(class_dir):].lstrip("/")
            if fi.type != pafs.FileType.File or _hidden(rel) or not _is_image(rel.rsplit("/", 1)[-1]):
                continue  # non-images (README, .txt) and hidden files are not samples
            paths.append(f"{folder}/{name}/{rel}" if folder else f"{name}/{rel}")
            sizes.append(int(fi.size or 0))
            mtimes.append(int(fi.mtime_ns if fi.mtime_ns is not None else 0))
        return paths, sizes, mtimes

    if not names:
        return {}
    out = {}
    with ThreadPoolExecutor(min(LIST_THREADS, len(names))) as pool:
        # Columns are built here, on this thread, as each class arrives: Arrow's allocator keeps a heap per
        # thread, and arrays made in 32 short-lived listing threads left their pages behind in the driver.
        for name, (paths, sizes, mtimes) in zip(names, pool.map(one, names)):
            out[name] = pa.table({"path": pa.array(paths, pa.string()), "size": pa.array(sizes, pa.int64()),
                                  "mtime_ns": pa.array(mtimes, pa.int64())})
    return out


def detect_kind(root: str) -> str:
    """'parquet', 'webdataset' or 'imagefolder', from the files at the top of ``root`` or in its data/,
    train/, val/ or validation/ folder (a few small listings, never a walk of an ImageFolder tree)."""
    norm = storage.normalise(root)
    fs, base = resolve_fs(norm)
    try:
        info = fs.get_file_info(base)
        if info.type != pafs.FileType.Directory:
            return "imagefolder"  # list_imagefolder reports the missing path or the file
        top = storage.list_dir(base, detail=True, fs=fs)
        names = [i.base_name.lower() for i in top if i.type == pafs.FileType.File]
        for sub in (i for i in top if i.type == pafs.FileType.Directory
                    and i.base_name.lower() in ("data", "train", "val", "validation")):
            names += [i.base_name.lower() for i in storage.list_dir(sub.path, detail=True, fs=fs)
                      if i.type == pafs.FileType.File]
    except OSError as exc:
        raise DataError(f"{root}: cannot read the source ({exc}); expected an ImageFolder tree, Parquet files "
                        "or WebDataset tar shards") from None
    if any(n.endswith(".parquet") for n in names):
        return "parquet"
    if any(n.endswith(".tar") for n in names):
        return "webdataset"
    return "imagefolder"


DEFAULT_VAL_FRACTION = 0.1  # what a run holds out of a train-only source when data.val_fraction is 0


def run_val_fraction(root: str, val_fraction: float) -> float:
    """The hold-out a training run uses: ``val_fraction`` if set, else DEFAULT_VAL_FRACTION for a source
    without a ``val/`` folder and 0 (use ``val/``) for one with it."""
    if val_fraction > 0:
        return val_fraction
    fs, base = resolve_fs(storage.normalise(root))
    try:
        has_val = any(i.type == pafs.FileType.Directory for i in fs.get_file_info(
            [f"{base}/{d}" for d in SPLIT_FOLDERS["val"]]))
    except OSError:
        has_val = True  # unreadable: leave it to the listing, which names the problem
    return 0.0 if has_val else DEFAULT_VAL_FRACTION


def hold_out(listing: SourceListing, fraction: float, seed: int) -> None:
    """Move round(fraction * n) images of every train class (n images) into a ``val`` split, in place.

    Which images: the first of the class's files ordered by sha256(seed, path), so the split depends on
    the seed and the file names only (not on other classes, the listing order or a library's RNG), and
    is the same on every machine and at every resume. Raises DataError naming the class when its
    hold-out would be empty or take every image (a class needs at least 2 images, and enough for
    ``fraction`` to round to at least one but not all of them)."""
    if not 0.0 < fraction < 1.0:
        raise DataError(f"data.val_fraction: bad value {fraction!r}; expected a fraction in (0, 1)")
    train = listing.splits["train"]
    labels = train.column("label")
    val_rows, per_class = rank_holdout(
        labels, lambda rows: train.table.column("path").take(pa.array(rows)).to_pylist(), fraction, seed,
        listing.classes, lambda name: _join_parts(listing.root, listing.split_dirs["train"], name), "image",
        "a val/ folder")
    # The split is sorted by path, so sorted row numbers are the path order of the rows they pick.
    listing.splits["train"] = train.take(np.setdiff1d(np.arange(len(labels)), val_rows))
    listing.splits["val"] = val = train.take(val_rows)
    digest = hashlib.sha256()
    for lo in range(0, len(val), _ROW_BATCH):
        _update_lines(digest, [val.table.column("path").slice(lo, _ROW_BATCH)], "")
    listing.holdout = {"from": "train", "val_fraction": float(fraction), "seed": int(seed),
                       "train_val_per_class": per_class, "val_paths_sha256": digest.hexdigest()}


def rank_holdout(labels: np.ndarray, paths_of: Any, fraction: float, seed: int, names: list[str], where: Any,
                 what: str, instead: str) -> tuple[np.ndarray, dict[str, list[int]]]:
    """The rows of a stratified hold-out (sorted) and the (train, val) counts per class: round(fraction * n) of
    every class's n rows, the first in sha256(seed, path) order, so the split depends on the seed and the paths
    alone. ``paths_of(rows)`` gives the rows' paths (one class at a time); a class too small for the fraction is a
    DataError at ``where(name)`` counting its ``what``s and suggesting ``instead``."""
    val_parts, per_class = [], {}
    for label in np.unique(labels[labels >= 0]).tolist():
        rows = np.flatnonzero(labels == label)  # the class's rows, in listing order
        n, name = len(rows), names[label]
        k = int(n * fraction + 0.5)
        if n < 2 or not 0 < k < n:
            raise DataError(f"{where(name)}: class {name!r} has {n} {what}(s); a {fraction:g} hold-out would take {k} "
                            f"of them (the source has no validation split); expected at least "
                            f"{max(2, math.ceil(0.5 / fraction))} {what}s per class, a larger data.val_fraction, or "
                            f"{instead}")
        keys = [hashlib.sha256(f"{seed}\0{p}".encode()).digest() for p in paths_of(rows)]
        val_parts.append(rows[sorted(range(n), key=keys.__getitem__)[:k]])
        per_class[name] = [n - k, k]
    val = np.sort(np.concatenate(val_parts)) if val_parts else np.zeros(0, np.int64)
    return val, per_class


def local_path_or_none(root: str) -> str | None:
    """The local directory behind ``root``, or None for a remote URI."""
    norm = storage.normalise(root)
    return None if is_uri(norm) else norm

