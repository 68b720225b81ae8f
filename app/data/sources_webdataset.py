"""WebDataset sources: tar shards whose consecutive members share a key (``00042.jpg`` + ``00042.cls``).

A sample is one key: its image is the ``.jpg`` / ``.jpeg`` / ``.png`` / ``.webp`` member and its label the
``.cls`` member (an integer as text) or else the ``.txt`` member (a class name). The tar is streamed once
(``tarfile`` over a pyarrow input stream, so s3:// works the same): no per-member seeks. Row counts are
only known after reading, so each tar is one work unit. Class names come from ``classes.json`` beside the
shards (required for ``.txt`` labels); without it, integer labels give ``"0".."max"`` once every shard is
built.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from typing import Any

import pyarrow.fs as pafs

from lightray.data.source import DataError
from lightray.data.sources_rows import (
    RowListing,
    held_out,
    list_containers,
    need_splits,
    no_split_for_fraction,
    read_classes_json,
    row_path,
    sample_id,
)

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
LABEL_EXTS = ("cls", "txt")


def _error(msg: str) -> Exception:
    return DataError(msg)


def _split_key(name: str) -> tuple[str, str]:
    """WebDataset's rule: the key is the path up to the first dot of the file name; the rest is the field."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def _groups(fileobj: Any) -> Iterator[tuple[str, dict[str, bytes]]]:
    key, fields = None, {}
    with tarfile.open(fileobj=fileobj, mode="r|*") as tar:
        for member in tar:
            if not member.isfile():
                continue
            k, ext = _split_key(member.name)
            if k != key and key is not None:
                yield key, fields
                fields = {}
            key = k
            fh = tar.extractfile(member)
            fields[ext] = fh.read() if fh is not None else b""
    if key is not None:
        yield key, fields


def _label_kind(fs: pafs.FileSystem, path: str) -> str:
    """'cls' or 'txt': the label field of the first sample that has one (reads the first few members only)."""
    with fs.open_input_stream(path) as stream:
        for i, (_key, fields) in enumerate(_groups(stream)):
            for ext in LABEL_EXTS:
                if ext in fields:
                    return ext
            if i >= 16:
                break
    return "cls"


def list_webdataset(root: str, base: str, fs: pafs.FileSystem, val_fraction: float = 0.0, seed: int = 0,
                    explicit: bool = True) -> RowListing:
    """List tar shards. ``val_fraction`` > 0 on a source without val tars holds out each key whose
    sha256(seed, path) falls in that fraction (rows are only known once read, so the hold-out is decided per
    row while reading, and is not stratified by class); ``explicit`` as for Parquet sources."""
    found = list_containers(root, base, fs, (".tar",))
    need_splits(root, found, "tar shards")
    first = found["train"][0].path
    kind = _label_kind(fs, f"{base}/{first}")
    classes = read_classes_json(base, fs)
    if classes is None and kind == "txt":
        raise _error(f"{root}/{first}: labels are class names (.txt) but there is no classes.json beside the "
                     "shards; expected classes.json listing the class names (index = label)")
    listing = RowListing(root=root, kind="webdataset", classes=classes or [], splits=found,
                         options={"label_field": kind})
    if val_fraction > 0 and "val" in found:
        no_split_for_fraction(root, val_fraction, explicit)
    elif val_fraction > 0:
        if not 0.0 < val_fraction < 1.0:
            raise _error(f"data.val_fraction: bad value {val_fraction!r}; expected a fraction in (0, 1)")
        found["val"] = list(found["train"])
        listing.holdout = {"from": "train", "val_fraction": float(val_fraction), "seed": int(seed),
                           "by": "sha256(seed, key path) per row"}
    return listing


def plan_units(listing: RowListing, split: str, limit: int, shard_rows: int) -> list[dict[str, Any]]:
    """One unit per tar. A limit takes the first ``ceil(limit / tars)`` samples of each tar (counts are
    unknown before reading; shards are conventionally shuffled when written)."""
    files = listing.splits[split]
    per_file = -(-limit // len(files)) if limit else 0
    keep = {"holdout": {**listing.holdout, "keep": split}} if listing.holdout else {}
    return [{"file": f.path, "file_index": fi, "listed": -1, "max_rows": per_file, **keep}
            for fi, f in enumerate(files)]


def iter_samples(unit: dict[str, Any], fs: pafs.FileSystem, base: str
                 ) -> Iterator[tuple[int, str, int | None, bytes | None, str]]:
    """(sample_id, path, label, image bytes, reason) per key of the tar, in tar order."""
    classes = unit["classes"]
    index = {c: i for i, c in enumerate(classes)}
    rel, max_rows = unit["file"], int(unit.get("max_rows") or 0)
    hold = unit.get("holdout")
    row = 0
    with fs.open_input_stream(f"{base}/{rel}") as stream:
        groups = _groups(stream)
        while not max_rows or row < max_rows:
            try:
                item = next(groups)
            except StopIteration:
                break
            except (tarfile.TarError, OSError, EOFError) as exc:
                yield sample_id(unit["file_index"], row), row_path(rel, f"{row}:rest"), None, None, \
                    f"unreadable tar from sample {row} on ({exc})"
                break
            key, fields = item
            sid, path = sample_id(unit["file_index"], row), row_path(rel, key)
            row += 1
            if hold and held_out(hold["seed"], path, hold["val_fraction"]) != (hold["keep"] == "val"):
                continue  # the other side of the hold-out
            data = next((fields[e] for e in IMAGE_EXTS if e in fields), None)
            label, reason = _label(fields, index, classes)
            if data is None:
                yield sid, path, None, None, f"no image member (.{', .'.join(IMAGE_EXTS)}) for this key"
            elif label is None:
                yield sid, path, None, None, reason
            else:
                yield sid, path, label, data, ""


def _label(fields: dict[str, bytes], index: dict[str, int], classes: list[str]) -> tuple[int | None, str]:
    if "cls" in fields:
        text = fields["cls"].decode("utf-8", "replace").strip()
        try:
            value = int(text)
        except ValueError:
            if text in index:
                return index[text], ""
            return None, f".cls {text!r} is not an integer label"
        if value < 0 or (classes and value >= len(classes)):
            return None, f"label {value} is outside 0..{len(classes) - 1}"
        return value, ""
    if "txt" in fields:
        text = fields["txt"].decode("utf-8", "replace").strip()
        return (index[text], "") if text in index else (None, f"label {text!r} is not among the classes")
    return None, "no label member (.cls or .txt) for this key"
