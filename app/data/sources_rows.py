"""Sources whose samples are rows inside container files (Parquet, WebDataset tars), not one file per image.

The listing holds one record per container file (path, size, mtime, row count when the format says it
cheaply), never one per sample: at ImageNet scale that is a few hundred records, not 1.28 M. A sample's
id is ``(file index << 32) | row index`` inside its split, so it is stable for the same files and a bad
row never shifts another row's id or label.

Splits come from a ``train/`` / ``val/`` (or ``validation/``) folder anywhere in the file's path, or from
the file-name prefix (``train-00000-of-00294.parquet``, ``validation-*.parquet``, ``val-000.tar``): the
Hugging Face and WebDataset naming. Files of other splits (``test-*``) are not samples.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from lightray import storage
from lightray.data.source import DataError
from lightray.storage import join

ROW_BITS = 32  # sample_id = file_index << ROW_BITS | row
SPLIT_NAMES = {"train": "train", "training": "train", "val": "val", "valid": "val", "validation": "val"}
_PREFIX = re.compile(r"^([A-Za-z]+)(?:[-_.]|$)")


@dataclass(frozen=True)
class RowFile:
    path: str  # relative to the source root, "/"-separated
    size: int
    mtime_ns: int
    num_rows: int  # -1 when unknown before reading (tar files)


@dataclass
class RowListing:
    """A container-file source: what ``prepare`` needs to plan one work unit per file (or row range)."""

    root: str
    kind: str  # "parquet" | "webdataset"
    classes: list[str]  # [] = derived from the labels once the shards are built (int labels, no names)
    splits: dict[str, list[RowFile]] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)  # column names, label kind: part of the key
    # A hold-out drawn from train (a source without a validation split): how, and per split the rows taken,
    # as indices into the train files' rows back to back (the val split lists the train files).
    holdout: dict | None = None
    picked: dict[str, Any] = field(default_factory=dict)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(f"root\0{self.root}\nkind\0{self.kind}\nclasses\0{chr(0).join(self.classes)}\n".encode())
        h.update(repr(sorted(self.options.items())).encode())
        if self.holdout is not None:
            h.update(f"holdout\0{self.holdout['val_fraction']!r}\0{self.holdout['seed']}\n".encode())
        for split in sorted(self.splits):
            for f in self.splits[split]:
                h.update(f"{split}\0{f.path}\0{f.size}\0{f.mtime_ns}\0{f.num_rows}\n".encode())
        return h.hexdigest()

    def num_files(self, split: str) -> int:
        """Samples listed in ``split`` (rows), or -1 when a file's row count is only known after reading."""
        rows = [f.num_rows for f in self.splits.get(split, [])]
        if split in self.picked:
            return len(self.picked[split])
        return -1 if any(n < 0 for n in rows) else sum(rows)


def split_of(rel: str) -> str | None:
    """'train' / 'val' from a folder name in the path or the file-name prefix; None for other splits."""
    parts = rel.split("/")
    for folder in parts[:-1]:
        if folder.lower() in SPLIT_NAMES:
            return SPLIT_NAMES[folder.lower()]
    m = _PREFIX.match(parts[-1])
    return SPLIT_NAMES.get(m.group(1).lower()) if m else None


def list_containers(root: str, base: str, fs: Any, suffixes: tuple[str, ...]) -> dict[str, list[RowFile]]:
    """Container files under ``base`` grouped by split, each sorted by path (one recursive listing)."""
    out: dict[str, list[RowFile]] = {}
    for fi in storage.list_dir(base, detail=True, recursive=True, fs=fs):
        rel = fi.path[len(base):].lstrip("/")
        if fi.type != storage.FileType.File or not rel.lower().endswith(suffixes):
            continue
        if any(p.startswith((".", "_")) for p in rel.split("/")):
            continue
        split = split_of(rel)
        if split is None:
            continue
        out.setdefault(split, []).append(RowFile(rel, int(fi.size or 0), int(fi.mtime_ns or 0), -1))
    for files in out.values():
        files.sort(key=lambda f: f.path)
    return out


def read_classes_json(base: str, fs: Any) -> list[str] | None:
    """``classes.json`` beside the data: a list of names (index = label), or {name: index}."""
    for name in ("classes.json", "class_names.json"):
        path = f"{base}/{name}"
        if storage.exists(path, fs=fs):
            data = storage.read_json(path, fs=fs)
            if isinstance(data, dict):
                return [k for k, _ in sorted(data.items(), key=lambda kv: int(kv[1]))]
            return [str(c) for c in data]
    return None


def sample_id(file_index: int, row: int) -> int:
    return (int(file_index) << ROW_BITS) | int(row)


def row_path(rel: str, row: int | str) -> str:
    """The ``path`` recorded for a row (shards, bad_files.json): ``train-00000.parquet#17``."""
    return f"{rel}#{row}"


def need_splits(root: str, found: dict[str, list[RowFile]], what: str) -> None:
    if "train" not in found:
        raise DataError(f"{root}: no train {what}; expected train/ and val/ folders or file names starting "
                        f"with train- / validation- (found splits: {', '.join(sorted(found)) or 'none'})")


def held_out(seed: int, path: str, fraction: float) -> bool:
    """Whether the row at ``path`` is in a hash hold-out of ``fraction``: depends on the seed and the row's
    path alone (for tars, whose rows are known only once read)."""
    digest = hashlib.sha256(f"{seed}\0{path}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2.0**64


def no_split_for_fraction(root: str, fraction: float, explicit: bool) -> None:
    """A source that has a validation split takes no hold-out: an error when the user asked for one."""
    if explicit:
        raise DataError(f"{root}: the source has a validation split, so data.val_fraction={fraction} has nothing "
                        "to do; expected data.val_fraction=0 (use the split) or a source without one")


def class_index(classes: list[str]) -> dict[str, int]:
    return {c: i for i, c in enumerate(classes)}


def describe(root: str, rel: str) -> str:
    return join(root, rel)
