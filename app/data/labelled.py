"""Labelled images for ``lightray eval --data`` from a source of any kind training takes: an ImageFolder tree
(``PATH/val/<class>/*`` or ``PATH/<class>/*``), Parquet files or WebDataset tars, local or s3://.

A container source is scored as it is held: its validation files when it names some (``validation-*.parquet``,
``val/``), else every Parquet file (or tar) under PATH, which is how a held-out split usually travels (a folder
of ``test-*.parquet``). The source's class names (``classes.json``, the Hugging Face ``ClassLabel``, or string
labels) are matched to the model's by name; integer labels without names are the model's class indices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightray import storage
from lightray.data import images, sources_parquet, sources_webdataset
from lightray.data.source import DataError, detect_kind, resolve_fs
from lightray.data.sources_rows import read_classes_json, split_of


def container_files(data: str, suffix: str) -> list[str]:
    """Paths (relative to ``data``) of the source's validation files, else of every ``suffix`` file under it."""
    norm = storage.normalise(data)
    fs, base = resolve_fs(norm)
    rel = sorted(i.path[len(base):].lstrip("/") for i in storage.list_dir(base, detail=True, recursive=True, fs=fs)
                 if i.type == storage.FileType.File and i.path.lower().endswith(suffix))
    rel = [r for r in rel if not any(p.startswith((".", "_")) for p in r.split("/"))]
    val = [r for r in rel if split_of(r) == "val"]
    return val or rel


def _class_map(source_names: list[str] | None, classes: list[str], where: str) -> Callable[[Any], int]:
    """Source label -> the model's class index; unknown names are an error naming them."""
    if source_names is None:  # integer labels without names: the model's own indices
        def by_index(raw: Any) -> int:
            if not 0 <= int(raw) < len(classes):
                raise DataError(f"{where}: label {raw} is outside the model's 0..{len(classes) - 1}")
            return int(raw)
        return by_index
    index = {c: i for i, c in enumerate(classes)}
    unknown = [n for n in source_names if n not in index]
    if unknown:
        raise DataError(f"{where}: class names {unknown[:5]} are not among the model's classes "
                        f"({', '.join(classes[:5])}{', ...' if len(classes) > 5 else ''})")
    return lambda raw: index[source_names[int(raw)]] if not isinstance(raw, str) else index[raw]


def row_items(data: str, classes: list[str], make_item: Callable[[str, int, Callable[[], Any]], Any],
              load: Callable[[bytes], Any]) -> list[Any]:
    """``make_item(name, label, loader)`` for every labelled row of a Parquet or WebDataset source; a row without
    an image or label becomes an item whose loader raises (it is skipped and listed, as an unreadable file)."""
    kind = detect_kind(data)
    norm = storage.normalise(data)
    fs, base = resolve_fs(norm)
    files = container_files(norm, ".parquet" if kind == "parquet" else ".tar")
    if not files:
        raise FileNotFoundError(f"--data: no {'Parquet files' if kind == 'parquet' else 'tar shards'} under {data}")
    names = read_classes_json(base, fs)
    if kind == "parquet":
        import pyarrow.parquet as pq

        with fs.open_input_file(f"{base}/{files[0]}") as fh:
            schema = pq.read_schema(fh)
        where = storage.join(norm, files[0])
        label_col, label_kind = sources_parquet._label_column(schema, where)
        opts = {"image_col": sources_parquet._image_column(schema, where), "label_col": label_col}
        names = names or sources_parquet._hf_names(schema, label_col)
        source_classes = names if names is not None else (None if label_kind == "int" else list(classes))
        to_model = _class_map(source_classes, classes, where)
        iters = [sources_parquet._file_samples({"file": f, "file_index": i, "range": [0, _rows(fs, base, f)]},
                                               {"options": opts, "classes": source_classes or list(classes)},
                                               fs, base) for i, f in enumerate(files)]
    else:
        to_model = _class_map(names, classes, norm)
        iters = [sources_webdataset.iter_samples({"file": f, "file_index": i, "classes": names or list(classes)},
                                                 fs, base) for i, f in enumerate(files)]
    out = []
    for stream in iters:
        for _sid, path, label, blob, reason in stream:
            if blob is None:
                out.append(make_item(path, 0, _raiser(reason)))
            else:
                out.append(make_item(path, to_model(label), (lambda b=blob: load(b))))
    return out


def _rows(fs: Any, base: str, rel: str) -> int:
    import pyarrow.parquet as pq

    with fs.open_input_file(f"{base}/{rel}") as fh:
        return pq.read_metadata(fh).num_rows


def _raiser(reason: str) -> Callable[[], Any]:
    def fail() -> Any:
        raise images.BadImage(reason)
    return fail
