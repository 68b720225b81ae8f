"""Source listing: an ImageFolder tree (``train/<class>/*.jpg``, ``val/<class>/*.jpg``) on any filesystem;
``detect_kind`` also recognises Parquet files and WebDataset tar shards (listed by app/data/sources.py).

The listing is the identity of the source: every file's relative path, size and modification time go
into the shard cache key, so a changed, added or removed image gives a new cache. It is sorted and
stable, so ``sample_id`` (an entry's index in its split) means the same file on every run and machine.
All checks happen here, on the driver, before any Ray worker starts: a bad tree fails in seconds with
a message naming the path, not minutes later inside a task.
"""

from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pyarrow.fs as pafs

from app import storage
from app.storage import is_uri, join

# torchvision's IMG_EXTENSIONS, compared case-insensitively (ImageNet has a few upper-case names).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SPLITS = ("train", "val")
LIST_THREADS = 32  # class folders listed at once (object-store listings are latency-bound)


class DataError(ValueError):
    """A problem with the input data or the shard cache; the message names the path and what was expected."""


@dataclass(frozen=True)
class SourceEntry:
    path: str  # relative to the source root, "/"-separated: "train/n01440764/x.JPEG"
    size: int
    mtime_ns: int
    label: int


@dataclass
class SourceListing:
    root: str  # the normalised source: an absolute local path or a URI (s3://bucket/prefix)
    classes: list[str]  # index = label
    splits: dict[str, list[SourceEntry]] = field(default_factory=dict)
    holdout: dict | None = None  # how val/ was drawn from train/ when the source has no val/ (see hold_out)

    def fingerprint(self) -> str:
        """sha256 over the root and every entry (path, size, mtime): the source half of the cache key."""
        h = hashlib.sha256()
        h.update(f"root\0{self.root}\nclasses\0{chr(0).join(self.classes)}\n".encode())
        if self.holdout is not None:
            h.update(f"holdout\0{self.holdout['val_fraction']!r}\0{self.holdout['seed']}\n".encode())
        for split in sorted(self.splits):
            for e in self.splits[split]:
                h.update(f"{split}\0{e.path}\0{e.size}\0{e.mtime_ns}\0{e.label}\n".encode())
        return h.hexdigest()

    def num_files(self, split: str) -> int:
        return len(self.splits.get(split, []))


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


def list_imagefolder(root: str, val_fraction: float = 0.0, seed: int = 0) -> SourceListing:
    """List ``root/{train,val}/<class>/**/<image>`` sorted by relative path.

    Classes are the sorted folder names of ``train/``; ``val/`` must use only those. Raises DataError
    for a missing root, no ``train/`` split, a split or class folder without images, or an unknown
    val class. ``val_fraction`` > 0 on a source without ``val/`` holds out that fraction of each train
    class as the val split (:func:`hold_out`, seeded by ``seed``); with a ``val/`` folder present it is a
    DataError (which split to score would be ambiguous). 0 lists a train-only source as it is.
    """
    norm = storage.normalise(root)
    fs, base = resolve_fs(norm)
    try:
        info = fs.get_file_info(base)
    except OSError as exc:
        raise DataError(f"{root}: cannot read the source ({exc}); expected an ImageFolder tree") from None
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"{root}: no such path; expected an ImageFolder tree with train/<class>/ folders")
    if info.type != pafs.FileType.Directory:
        raise DataError(f"{root}: is a file; expected a directory with train/<class>/ folders")
    top = {i.base_name: i for i in storage.list_dir(base, detail=True, fs=fs)}
    if "train" not in top or top["train"].type != pafs.FileType.Directory:
        found = ", ".join(sorted(top)) or "nothing"
        raise DataError(f"{join(norm, 'train')}: missing; expected a train/ split folder with one folder per "
                        f"class (found {found})")

    listing = SourceListing(root=norm, classes=[])
    per_split: dict[str, dict[str, list[tuple[str, int, int]]]] = {}
    for split in SPLITS:
        if split not in top:
            continue
        classes = _list_split(fs, f"{base}/{split}", split)
        if not any(classes.values()):
            raise DataError(f"{join(norm, split)}: no images; expected class folders holding files with extensions "
                            f"{', '.join(IMAGE_EXTENSIONS)}")
        for name, files in sorted(classes.items()):
            if not files:
                raise DataError(f"{join(norm, split, name)}: class folder has no images; expected files with "
                                f"extensions {', '.join(IMAGE_EXTENSIONS)} (remove the folder or add images)")
        per_split[split] = classes

    listing.classes = sorted(per_split["train"])
    index = {name: i for i, name in enumerate(listing.classes)}
    for split, classes in per_split.items():
        unknown = sorted(set(classes) - set(index))
        if unknown:
            raise DataError(f"{join(norm, split, unknown[0])}: class {unknown[0]!r} is not among the "
                            f"{len(index)} train classes; expected val/ to use train/'s class folders")
        entries = [SourceEntry(path, size, mtime, index[name])
                   for name, files in classes.items() for path, size, mtime in files]
        entries.sort(key=lambda e: e.path)
        listing.splits[split] = entries
    if "val" in listing.splits and val_fraction > 0:
        raise DataError(f"{join(norm, 'val')}: the source has a val/ split, so data.val_fraction={val_fraction} "
                        "has nothing to do; expected data.val_fraction=0 (use val/) or a source without val/")
    if "val" not in listing.splits and val_fraction > 0:
        hold_out(listing, val_fraction, seed)
    return listing


def _list_split(fs: pafs.FileSystem, split_dir: str, split: str) -> dict[str, list[tuple[str, int, int]]]:
    """{class folder: [(relative path, size, mtime_ns), ...]} of one split, the class folders listed in
    parallel: one recursive listing per class, ``LIST_THREADS`` at a time. On an object store a single
    recursive listing of the split is one paged request after another (1,000 keys a page: over a thousand
    round trips for ImageNet's train split); per class the pages of different classes overlap. Locally the
    threads overlap the directory reads. The order of the result does not matter: the caller sorts."""
    top = storage.list_dir(split_dir, detail=True, fs=fs)
    names = [i.base_name for i in top if i.type == pafs.FileType.Directory and not _hidden(i.base_name)]

    def one(name: str) -> tuple[str, list[tuple[str, int, int]]]:
        class_dir = f"{split_dir}/{name}"
        files = []
        for fi in storage.list_dir(class_dir, detail=True, recursive=True, fs=fs):
            rel = fi.path[len(class_dir):].lstrip("/")
            if fi.type != pafs.FileType.File or _hidden(rel) or not _is_image(rel.rsplit("/", 1)[-1]):
                continue  # non-images (README, .txt) and hidden files are not samples
            mtime = fi.mtime_ns if fi.mtime_ns is not None else 0
            files.append((f"{split}/{name}/{rel}", int(fi.size or 0), int(mtime)))
        return name, files

    if not names:
        return {}
    with ThreadPoolExecutor(min(LIST_THREADS, len(names))) as pool:
        return dict(pool.map(one, names))


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
        has_val = fs.get_file_info(f"{base}/val").type == pafs.FileType.Directory
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
    by_class: dict[int, list[SourceEntry]] = {}
    for e in listing.splits["train"]:
        by_class.setdefault(e.label, []).append(e)
    train: list[SourceEntry] = []
    val: list[SourceEntry] = []
    per_class: dict[str, list[int]] = {}
    digest = hashlib.sha256()
    for label, entries in sorted(by_class.items()):
        n, name = len(entries), listing.classes[label]
        k = int(n * fraction + 0.5)
        if n < 2 or not 0 < k < n:
            raise DataError(f"{join(listing.root, 'train', name)}: class {name!r} has {n} image(s); a "
                            f"{fraction:g} hold-out would take {k} of them (the source has no val/ split); "
                            f"expected at least {max(2, math.ceil(0.5 / fraction))} images per class, a "
                            "larger data.val_fraction, or a val/ folder")
        ranked = sorted(entries, key=lambda e: hashlib.sha256(f"{seed}\0{e.path}".encode()).digest())
        val.extend(ranked[:k])
        train.extend(ranked[k:])
        per_class[name] = [n - k, k]
    train.sort(key=lambda e: e.path)
    val.sort(key=lambda e: e.path)
    for e in val:
        digest.update(f"{e.path}\n".encode())
    listing.splits["train"], listing.splits["val"] = train, val
    listing.holdout = {"from": "train", "val_fraction": float(fraction), "seed": int(seed),
                       "train_val_per_class": per_class, "val_paths_sha256": digest.hexdigest()}


def local_path_or_none(root: str) -> str | None:
    """The local directory behind ``root``, or None for a remote URI."""
    norm = storage.normalise(root)
    return None if is_uri(norm) else norm

