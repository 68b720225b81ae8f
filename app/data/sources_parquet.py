"""Parquet sources: an image column (bytes, or a ``{bytes, path}`` struct as in the Hugging Face
``imagenet-1k`` layout) and a label column (integer or string), read with pyarrow.

The driver reads only each file's footer (row count, schema) and, when no class names are given, the
label column (to find the string classes or the largest integer label). Class names come from
``classes.json`` beside the data, else the Hugging Face ``features`` in the schema metadata
(``huggingface`` key, a ``ClassLabel``'s ``names``), else the sorted string labels of the train split,
else ``"0".."max"`` for integer labels. Work units are row ranges of one file, so a task opens one file.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from lightray.data import mix
from lightray.data.source import DataError, rank_holdout
from lightray.data.sources_rows import (
    RowFile,
    RowListing,
    list_containers,
    need_splits,
    no_split_for_fraction,
    read_classes_json,
    row_path,
    sample_id,
)

log = logging.getLogger("lightray.prepare")
IMAGE_COLUMNS = ("image", "img", "jpg", "jpeg", "png", "image_bytes")
LABEL_COLUMNS = ("label", "labels", "cls", "class", "target")


def _error(msg: str) -> Exception:
    return DataError(msg)


def _image_column(schema: pa.Schema, where: str) -> str:
    def usable(t: pa.DataType) -> bool:
        return (pa.types.is_binary(t) or pa.types.is_large_binary(t)
                or (pa.types.is_struct(t) and t.get_field_index("bytes") >= 0))

    names = [n for n in IMAGE_COLUMNS if n in schema.names and usable(schema.field(n).type)]
    names += [f.name for f in schema if usable(f.type) and f.name not in names]
    if not names:
        raise _error(f"{where}: no image column; expected a binary column or a {{bytes, path}} struct "
                     f"(columns: {', '.join(f'{f.name}: {f.type}' for f in schema)})")
    return names[0]


def _label_column(schema: pa.Schema, where: str) -> tuple[str, str]:
    for n in LABEL_COLUMNS:
        if n in schema.names:
            t = schema.field(n).type
            if pa.types.is_integer(t):
                return n, "int"
            if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t):
                return n, "str"
    raise _error(f"{where}: no label column; expected an integer or string column named one of "
                 f"{', '.join(LABEL_COLUMNS)} (columns: {', '.join(schema.names)})")


def _hf_names(schema: pa.Schema, label_col: str) -> list[str] | None:
    meta = (schema.metadata or {}).get(b"huggingface")
    if not meta:
        return None
    try:
        feat = json.loads(meta)["info"]["features"][label_col]
    except (ValueError, KeyError, TypeError):
        return None
    names = feat.get("names") if isinstance(feat, dict) else None
    return [str(n) for n in names] if names else None


def list_parquet(root: str, base: str, fs: pafs.FileSystem, val_fraction: float = 0.0, seed: int = 0,
                 explicit: bool = True) -> RowListing:
    """List a Parquet source (``root`` normalised, ``base`` its path inside ``fs``). ``val_fraction`` > 0 on a
    source without a validation split holds that fraction of each class out of train (:func:`hold_out`);
    ``explicit`` False (the run's default fraction) lets a source with a validation split use it silently."""
    found = list_containers(root, base, fs, (".parquet",))
    need_splits(root, found, "Parquet files")
    files = [(split, f) for split in sorted(found) for f in found[split]]

    def footer(item: tuple[str, RowFile]) -> pq.FileMetaData:
        with fs.open_input_file(f"{base}/{item[1].path}") as fh:
            return pq.read_metadata(fh)

    with ThreadPoolExecutor(16) as pool:  # footers are small; on object stores the reads are latency-bound
        metas = list(pool.map(footer, files))
    first = f"{root}/{found['train'][0].path}"
    schema = metas[files.index(("train", found["train"][0]))].schema.to_arrow_schema()
    image_col = _image_column(schema, first)
    label_col, label_kind = _label_column(schema, first)
    splits: dict[str, list[RowFile]] = {}
    for (split, f), meta in zip(files, metas):
        splits.setdefault(split, []).append(RowFile(f.path, f.size, f.mtime_ns, int(meta.num_rows)))

    classes = read_classes_json(base, fs) or _hf_names(schema, label_col)

    def labels(item: tuple[str, RowFile]) -> pa.ChunkedArray:
        with fs.open_input_file(f"{base}/{item[1].path}") as fh:
            return pq.read_table(fh, columns=[label_col]).column(label_col)

    # The train split's labels are always read (one small column per file): the shard plan needs them to
    # tell a class-sorted split from a shuffled one. Other splits only when their labels name the classes.
    wanted = files if classes is None and label_kind == "int" else [x for x in files if x[0] == "train"]
    with ThreadPoolExecutor(16) as pool:
        cols = dict(zip(wanted, pool.map(labels, wanted)))
    if classes is None:
        classes = _classes_from_labels(cols, label_kind)
    if not classes:
        raise _error(f"{first}: no labels in column {label_col!r}; expected class labels")
    train_labels = _label_codes([cols[x] for x in files if x[0] == "train"], classes)
    opts = {"image_col": image_col, "label_col": label_col, "label_kind": label_kind}
    listing = RowListing(root=root, kind="parquet", classes=classes, splits=splits, options=opts)
    if val_fraction > 0 and "val" in splits:
        no_split_for_fraction(root, val_fraction, explicit)
    elif val_fraction > 0:
        hold_out(listing, train_labels, val_fraction, seed)
        train_labels = train_labels[listing.picked["train"]]
    _mark_clustered(listing, train_labels)
    return listing


def _classes_from_labels(cols: dict[tuple[str, RowFile], pa.ChunkedArray], label_kind: str) -> list[str]:
    """The class names when no file names them: 0..max for integer labels, else the train split's sorted values."""
    if label_kind == "int":
        top = max((pc.max(c).as_py() for c in cols.values() if len(c)), default=None)
        return [str(i) for i in range((top if top is not None else -1) + 1)]
    uniq: set[str] = set()
    for (split, _), c in cols.items():
        if split == "train":
            uniq.update(v for v in pc.unique(c.cast(pa.string())).to_pylist() if v is not None)
    return sorted(uniq)


def _mark_clustered(listing: RowListing, train_labels: np.ndarray) -> None:
    """A train split sorted (or clustered) by class is marked for prepare to mix across shards."""
    score = mix.clustering(train_labels)
    if score > mix.LIMIT:
        # Part of the listing's fingerprint, so a cache built from row ranges is never reused for the mix.
        listing.options["mixed_splits"] = ["train"]
        log.warning("%s: the train rows are clustered by class (runs of %d consecutive rows are %.0f standard "
                    "deviations from fair samples); prepare mixes them across shards, reading each file's row "
                    "groups for many shards (a source written shuffled is read once, in order)", listing.root,
                    mix.check_rows(len(train_labels)), score)


def hold_out(listing: RowListing, labels: np.ndarray, fraction: float, seed: int) -> None:
    """Move round(fraction * n) rows of every train class (n rows) into a ``val`` split, in place: the first of
    the class's rows ordered by sha256(seed, row path), as an ImageFolder hold-out orders its files, so the
    split depends on the seed and the rows' places alone. Raises DataError naming the class when its hold-out
    would be empty or take every row."""
    if not 0.0 < fraction < 1.0:
        raise _error(f"data.val_fraction: bad value {fraction!r}; expected a fraction in (0, 1)")
    files = listing.splits["train"]
    starts = np.concatenate([[0], np.cumsum([f.num_rows for f in files])]).astype(np.int64)

    def paths_of(rows: np.ndarray) -> list[str]:
        fidx = np.searchsorted(starts, rows, side="right") - 1
        return [row_path(files[fi].path, r - starts[fi]) for fi, r in zip(fidx.tolist(), rows.tolist())]

    val, per_class = rank_holdout(labels, paths_of, fraction, seed, listing.classes, lambda name: listing.root,
                                  "row", "a validation split")
    listing.picked = {"val": val, "train": np.setdiff1d(np.arange(len(labels), dtype=np.int64), val)}
    listing.splits["val"] = list(files)  # the held-out rows live in the train files
    listing.holdout = {"from": "train", "val_fraction": float(fraction), "seed": int(seed),
                       "train_val_per_class": per_class}


def _label_codes(columns: list[pa.ChunkedArray], classes: list[str]) -> np.ndarray:
    """Class indices of the rows of ``columns`` in order (-1 for a missing or unknown label)."""
    if not columns:
        return np.zeros(0, np.int64)
    col = pa.chunked_array([c for col in columns for c in col.chunks], columns[0].type)
    if pa.types.is_integer(col.type):
        return np.asarray(col.fill_null(-1).to_numpy(), dtype=np.int64)
    codes = pc.index_in(col.cast(pa.string()), value_set=pa.array(classes, pa.string()))
    return np.asarray(codes.fill_null(-1).to_numpy(), dtype=np.int64)


def plan_units(listing: RowListing, split: str, limit: int, shard_rows: int) -> list[dict[str, Any]]:
    """Units of at most ``shard_rows`` rows. A limit takes evenly spaced rows over the whole split (every
    file, and so every class of a shuffled source, stays represented). A split the listing found clustered
    by class (``options["mixed_splits"]``) is cut in a seeded mix of its rows, as an ImageFolder listing is,
    so that each shard is a fair sample; each unit then reads its rows from every file that holds them.
    Otherwise a unit is a row range of one file, read in order."""
    files = listing.splits[split]
    starts = np.concatenate([[0], np.cumsum([f.num_rows for f in files])]).astype(np.int64)
    rows = listing.picked[split] if split in listing.picked else np.arange(starts[-1], dtype=np.int64)
    picked = rows[np.arange(limit, dtype=np.int64) * len(rows) // limit] if limit and limit < len(rows) else rows
    mixed = split in listing.options.get("mixed_splits", [])
    if mixed:
        picked = picked[mix.shard_order(len(picked), split)]
        units = []
        for lo in range(0, len(picked), shard_rows):
            # Within a unit rows go in file order: each file's row groups are read once, front to back.
            glob = np.sort(picked[lo:lo + shard_rows])
            fidx = np.searchsorted(starts, glob, side="right") - 1
            parts = [_part(files, fi, (glob[fidx == fi] - starts[fi]).tolist()) for fi in np.unique(fidx).tolist()]
            units.append({"parts": parts, "listed": len(glob)})
        return units
    fidx = np.searchsorted(starts, picked, side="right") - 1
    return [_part(files, fi, rows[lo:lo + shard_rows])
            for fi in range(len(files)) if (rows := (picked[fidx == fi] - starts[fi]).tolist())
            for lo in range(0, len(rows), shard_rows)]


def _part(files: list[RowFile], fi: int, take: list[int]) -> dict[str, Any]:
    """Rows ``take`` (sorted) of file ``fi``; a contiguous range is sent as its two ends, not every row."""
    spec = {"range": [take[0], take[-1] + 1]} if take[-1] - take[0] + 1 == len(take) else {"take": take}
    return {"file": files[fi].path, "file_index": fi, "listed": len(take), **spec}


def iter_samples(unit: dict[str, Any], fs: pafs.FileSystem, base: str
                 ) -> Iterator[tuple[int, str, int | None, bytes | None, str]]:
    """(sample_id, path, label, image bytes, reason) for each row of the unit; bytes None with a reason
    for a row without a usable image or label."""
    for part in unit.get("parts") or [unit]:
        yield from _file_samples(part, unit, fs, base)


def _file_samples(part: dict[str, Any], unit: dict[str, Any], fs: pafs.FileSystem, base: str
                  ) -> Iterator[tuple[int, str, int | None, bytes | None, str]]:
    """The rows of one file that ``part`` names (``range`` or ``take``), reading only their row groups."""
    opts = unit["options"]
    image_col, label_col = opts["image_col"], opts["label_col"]
    index = {c: i for i, c in enumerate(unit["classes"])}
    rows = list(range(*part["range"])) if "range" in part else list(part["take"])
    rel = part["file"]
    with fs.open_input_file(f"{base}/{rel}") as fh:
        pf = pq.ParquetFile(fh)
        bounds = np.cumsum([0] + [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)])
        # Only the row groups that hold the part's rows, only the two columns.
        group_of = np.searchsorted(bounds, np.asarray(rows), side="right") - 1
        groups = np.unique(group_of)
        table = pf.read_row_groups(groups.tolist(), columns=[image_col, label_col])
    # The table is the groups read, back to back: where each group starts in it, then each row's place.
    sizes = bounds[groups + 1] - bounds[groups]
    table_start = dict(zip(groups.tolist(), (np.cumsum(sizes) - sizes).tolist()))
    local = pa.array([table_start[g] + r - int(bounds[g]) for r, g in zip(rows, group_of.tolist())], pa.int64())
    images = table.column(image_col)
    if pa.types.is_struct(images.type):
        images = pc.struct_field(images, "bytes")
    images = images.take(local).to_pylist()
    labels = table.column(label_col).take(local).to_pylist()
    for r, data, raw in zip(rows, images, labels):
        sid, path = sample_id(part["file_index"], r), row_path(rel, r)
        label, reason = _label(raw, index, len(unit["classes"]))
        if data is None:
            yield sid, path, None, None, "no image bytes in the row"
        elif label is None:
            yield sid, path, None, None, reason
        else:
            yield sid, path, label, data, ""


def _label(raw: Any, index: dict[str, int], num_classes: int) -> tuple[int | None, str]:
    if raw is None:
        return None, "no label in the row"
    if isinstance(raw, str):
        return (index[raw], "") if raw in index else (None, f"label {raw!r} is not among the {num_classes} classes")
    if 0 <= int(raw) < num_classes:
        return int(raw), ""
    return None, f"label {raw} is outside 0..{num_classes - 1}"

