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
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from app.data.source import DataError
from app.data.sources_rows import (
    RowFile,
    RowListing,
    list_containers,
    need_splits,
    read_classes_json,
    row_path,
    sample_id,
)

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


def list_parquet(root: str, base: str, fs: pafs.FileSystem) -> RowListing:
    """List a Parquet source (``root`` normalised, ``base`` its path inside ``fs``)."""
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
    if classes is None:
        def labels(item: tuple[str, RowFile]) -> pa.ChunkedArray:
            with fs.open_input_file(f"{base}/{item[1].path}") as fh:
                return pq.read_table(fh, columns=[label_col]).column(label_col)

        wanted = files if label_kind == "int" else [x for x in files if x[0] == "train"]
        with ThreadPoolExecutor(16) as pool:
            cols = list(pool.map(labels, wanted))
        if label_kind == "int":
            top = max((pc.max(c).as_py() for c in cols if len(c)), default=None)
            classes = [str(i) for i in range((top if top is not None else -1) + 1)]
        else:
            uniq: set[str] = set()
            for c in cols:
                uniq.update(v for v in pc.unique(c.cast(pa.string())).to_pylist() if v is not None)
            classes = sorted(uniq)
    if not classes:
        raise _error(f"{first}: no labels in column {label_col!r}; expected class labels")
    opts = {"image_col": image_col, "label_col": label_col, "label_kind": label_kind}
    return RowListing(root=root, kind="parquet", classes=classes, splits=splits, options=opts)


def plan_units(listing: RowListing, split: str, limit: int, shard_rows: int) -> list[dict[str, Any]]:
    """Row ranges of one file, at most ``shard_rows`` rows each. A limit takes evenly spaced rows over the
    whole split (every file, and so every class of a shuffled source, stays represented)."""
    files = listing.splits[split]
    total = sum(f.num_rows for f in files)
    chosen: list[list[int]] = [[] for _ in files]
    if limit and limit < total:
        starts, acc = [], 0
        for f in files:
            starts.append(acc)
            acc += f.num_rows
        fi = 0
        for g in (i * total // limit for i in range(limit)):
            while g >= starts[fi] + files[fi].num_rows:
                fi += 1
            chosen[fi].append(g - starts[fi])
    else:
        chosen = [list(range(f.num_rows)) for f in files]
    units = []
    for fi, (f, rows) in enumerate(zip(files, chosen)):
        for lo in range(0, len(rows), shard_rows):
            take = rows[lo:lo + shard_rows]
            # A contiguous range is sent as its two ends, not as a list of every row.
            spec = {"range": [take[0], take[-1] + 1]} if take[-1] - take[0] + 1 == len(take) else {"take": take}
            units.append({"file": f.path, "file_index": fi, "listed": len(take), **spec})
    return units


def iter_samples(unit: dict[str, Any], fs: pafs.FileSystem, base: str
                 ) -> Iterator[tuple[int, str, int | None, bytes | None, str]]:
    """(sample_id, path, label, image bytes, reason) for each row of the unit; bytes None with a reason
    for a row without a usable image or label."""
    opts = unit["options"]
    image_col, label_col = opts["image_col"], opts["label_col"]
    index = {c: i for i, c in enumerate(unit["classes"])}
    rows = list(range(*unit["range"])) if "range" in unit else list(unit["take"])
    rel = unit["file"]
    with fs.open_input_file(f"{base}/{rel}") as fh:
        pf = pq.ParquetFile(fh)
        # Read only the row groups that hold the unit's rows, only the two columns.
        groups, starts, acc = [], [], 0
        lo, hi = rows[0], rows[-1] + 1
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if acc < hi and acc + n > lo:
                groups.append(g)
                starts.append(acc)
            acc += n
        table = pf.read_row_groups(groups, columns=[image_col, label_col])
    offset = starts[0] if starts else 0
    images = table.column(image_col)
    if pa.types.is_struct(images.type):
        images = pc.struct_field(images, "bytes")
    images = images.to_pylist()
    labels = table.column(label_col).to_pylist()
    for r in rows:
        sid, path = sample_id(unit["file_index"], r), row_path(rel, r)
        data, raw = images[r - offset], labels[r - offset]
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

