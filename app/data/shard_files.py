"""The shard cache's file layout, shared by prepare's two passes (``lightray.data.prepare``, ``lightray.data.remix``): a
shard's file name and its Parquet encoding, and the folder of per-shard sidecars."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

PROGRESS_DIR = "_progress"


def shard_file(split: str, tier: int, index: int) -> str:
    return f"{split}-{tier}-{index:05d}.parquet"


_SCHEMA = pa.schema([
    ("sample_id", pa.int64()), ("label", pa.int32()), ("image", pa.binary()), ("height", pa.int32()),
    ("width", pa.int32()), ("orig_height", pa.int32()), ("orig_width", pa.int32()), ("path", pa.string()),
])


def parquet_bytes(cols: dict[str, list]) -> bytes:
    table = pa.table({f.name: pa.array(cols[f.name], f.type) for f in _SCHEMA}, schema=_SCHEMA)
    sink = pa.BufferOutputStream()
    # Image bytes are JPEG (incompressible) or pixels read straight into memory: no codec, no dictionary,
    # no min/max statistics on them; a single row group per shard keeps reads to one seek.
    pq.write_table(table, sink, row_group_size=max(1, table.num_rows),
                   compression={"sample_id": "SNAPPY", "label": "SNAPPY", "path": "SNAPPY", "image": "NONE",
                                "height": "SNAPPY", "width": "SNAPPY", "orig_height": "SNAPPY",
                                "orig_width": "SNAPPY"},
                   use_dictionary=["label"], write_statistics=["sample_id", "label"])
    return sink.getvalue().to_pybytes()
