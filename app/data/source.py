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
from dataclasses import dataclass, field

import pyarrow.fs as pafs

from app import storage
from app.storage import is_uri, join

# torchvision's IMG_EXTENSIONS, compared case-insensitively (ImageNet has a few upper-case names).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SPLITS = ("train", "val")


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

    def fingerprint(self) -> str:
        """sha256 over the root and every entry (path, size, mtime): the source half of the cache key."""
        h = hashlib.sha256()
        h.update(f"root\0{self.root}\nclasses\0{chr(0).join(self.classes)}\n".encode())
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


def list_imagefolder(root: str) -> SourceListing:
    """List ``root/{train,val}/<class>/**/<image>`` sorted by relative path.

    Classes are the sorted folder names of ``train/``; ``val/`` must use only those. Raises DataError
    for a missing root, no ``train/`` split, a split or class folder without images, or an unknown
    val class.
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
        split_dir = f"{base}/{split}"
        classes: dict[str, list[tuple[str, int, int]]] = {}
        # One recursive listing per split: on object stores a directory walk would cost a request per folder.
        for fi in storage.list_dir(split_dir, detail=True, recursive=True, fs=fs):
            rel = fi.path[len(split_dir):].lstrip("/")
            if _hidden(rel):
                continue
            parts = rel.split("/")
            if fi.type == pafs.FileType.Directory:
                if len(parts) == 1:
                    classes.setdefault(parts[0], [])
                continue
            if len(parts) < 2 or fi.type != pafs.FileType.File or not _is_image(parts[-1]):
                continue  # loose files in the split folder and non-images (README, .txt) are not samples
            mtime = fi.mtime_ns if fi.mtime_ns is not None else 0
            classes.setdefault(parts[0], []).append((f"{split}/{rel}", int(fi.size or 0), int(mtime)))
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
    return listing


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


def local_path_or_none(root: str) -> str | None:
    """The local directory behind ``root``, or None for a remote URI."""
    norm = storage.normalise(root)
    return None if is_uri(norm) else norm

