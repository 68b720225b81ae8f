"""Any supported source, by kind: an ImageFolder tree, Parquet files or WebDataset tar shards."""

from __future__ import annotations

from lightray import storage
from lightray.data import sources_parquet, sources_webdataset
from lightray.data.source import SourceListing, detect_kind, list_imagefolder, resolve_fs
from lightray.data.sources_rows import RowListing


def list_source(root: str, val_fraction: float = 0.0, val_seed: int = 0,
                explicit: bool = True) -> SourceListing | RowListing:
    """The listing of ``root``: ``SourceListing`` for an ImageFolder tree, ``RowListing`` for Parquet files
    or WebDataset tar shards. Every input error is a DataError naming the path. ``val_fraction``/``val_seed``:
    the hold-out of a source without a validation split; ``explicit`` False (a run's default fraction, not the
    user's) lets a container source with validation files use them without complaint."""
    kind = detect_kind(root)
    if kind == "imagefolder":
        return list_imagefolder(root, val_fraction, val_seed)
    norm = storage.normalise(root)
    fs, base = resolve_fs(norm)
    lister = sources_parquet.list_parquet if kind == "parquet" else sources_webdataset.list_webdataset
    return lister(norm, base, fs, val_fraction, val_seed, explicit)
