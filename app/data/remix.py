"""A second pass of prepare for sources whose rows are only known once read (WebDataset tars): when the train
shards it built are clustered by class (a tar per class, or tars written in class order), they are cut again
into shards of a seeded mix of every train row, as an ImageFolder listing or a class-sorted Parquet split is
cut in the first place (``lightray.data.mix``).

The first pass reads each tar once, in order, and writes one shard per tar (all tiers). The remix reads those
shards (already resized and encoded: a fraction of the source's bytes) and writes shard j of every tier from
the same rows, so row i of shard j is still the same sample at every tier. Each remixed shard has its own
sidecar (``_progress/mix-train-<j>.json``): an interrupted remix builds only the missing ones next time. A
remixed shard reads from every first-pass shard that holds one of its rows: the pass costs about
(shards x shards) shard reads, cheap for the small tiers, and is logged with its size.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lightray import storage
from lightray.data import mix
from lightray.data.shard_files import PROGRESS_DIR, parquet_bytes, shard_file
from lightray.data.source import resolve_fs

log = logging.getLogger("lightray.prepare")
PREFIX = "mix-"


def counts(values: list[int]) -> dict[str, int]:
    """A {value: count} histogram with string keys, as a JSON sidecar keeps it."""
    return {str(k): v for k, v in Counter(values).items()}


def clustered_shards(sidecars: list[dict[str, Any]]) -> float:
    """How far the shards' class counts are from fair samples of the split, in standard deviations (the
    statistic of :func:`lightray.data.mix.clustering`, over whole shards of any size)."""
    counts = [{int(k): int(v) for k, v in sc.get("label_counts", {}).items()} for sc in sidecars if sc["rows"]]
    classes = sorted({k for c in counts for k in c})
    if len(counts) < 2 or len(classes) < 2:
        return 0.0
    table = np.array([[c.get(k, 0) for k in classes] for c in counts], dtype=np.float64)
    n = int(table.sum())
    return mix.counts_deviation(table, table.sum(0) / n, n)


def plan(sidecars: list[dict[str, Any]], shard_rows: int, split: str = "train") -> list[dict[str, Any]]:
    """Remix units: unit j takes rows ``order[j * shard_rows:(j + 1) * shard_rows]`` of a seeded mix of every
    row of the first-pass shards (``sidecars``, in shard order), as (first-pass shard, row) pairs."""
    built = [sc for sc in sidecars if sc["rows"]]
    where = np.concatenate([np.stack([np.full(sc["rows"], i), np.arange(sc["rows"])], 1) for i, sc in
                            enumerate(built)]) if built else np.zeros((0, 2), np.int64)
    where = where[mix.shard_order(len(where), split)]
    units = []
    for j, lo in enumerate(range(0, len(where), shard_rows)):
        part = where[lo:lo + shard_rows]
        part = part[np.lexsort((part[:, 1], part[:, 0]))]  # read each first-pass shard's rows front to back
        units.append({"split": split, "index": j, "take": part.tolist(),
                      "from": [{str(t): f["file"] for t, f in sc["files"].items()} for sc in built]})
    return units


def unit_name(split: str, index: int) -> str:
    return f"{PREFIX}{split}-{index:05d}"


def build(unit: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """Write remixed shard ``unit["index"]`` at every tier and its sidecar; returns the sidecar."""
    fs, base = resolve_fs(out_dir)
    take = np.asarray(unit["take"], np.int64).reshape(-1, 2)
    tiers = sorted(unit["from"][0]) if unit["from"] else []
    files: dict[str, dict[str, Any]] = {}
    labels: list[int] = []
    for t in tiers:
        parts = []
        for src in np.unique(take[:, 0]).tolist():
            table = pq.read_table(f"{base}/{unit['from'][src][t]}", filesystem=fs)
            parts.append(table.take(pa.array(take[take[:, 0] == src, 1])))
        cols = pa.concat_tables(parts).to_pydict()
        blob = parquet_bytes(cols)
        name = shard_file(f"{PREFIX}{unit['split']}", int(t), int(unit["index"]))
        storage.write_bytes(f"{base}/{name}", blob, fs=fs)
        files[t] = {"file": name, "rows": len(cols["sample_id"]), "sha256": hashlib.sha256(blob).hexdigest(),
                    "bytes": len(blob)}
        labels, sides = cols["label"], [min(h, w) for h, w in zip(cols["orig_height"], cols["orig_width"])]
    sidecar = {"split": unit["split"], "index": unit["index"], "rows": len(take), "listed": len(take),
               "files": files, "bad": [], "max_label": max(labels, default=-1), "label_counts": counts(labels),
               "short_sides": counts(sides)}
    storage.write_json(f"{base}/{PROGRESS_DIR}/{unit_name(unit['split'], unit['index'])}.json", sidecar, fs=fs)
    return sidecar


def _map(row: dict[str, Any], out_dir: str) -> dict[str, Any]:
    return {"sidecar": json.dumps(build(json.loads(row["unit"]), out_dir))}


def run(units: list[dict[str, Any]], out_dir: str, num_cpus: float, concurrency: int) -> dict[str, dict]:
    """Build the remix units whose sidecar is missing (Ray Data tasks, as the first pass); every sidecar by
    unit name."""
    import ray.data

    fs, base = resolve_fs(out_dir)
    done: dict[str, dict[str, Any]] = {}
    todo = []
    for u in units:
        path = f"{base}/{PROGRESS_DIR}/{unit_name(u['split'], u['index'])}.json"
        if storage.exists(path, fs=fs):
            sc = storage.read_json(path, fs=fs)
            if all(storage.exists(f"{base}/{f['file']}", fs=fs) for f in sc["files"].values()):
                done[unit_name(u["split"], u["index"])] = sc
                continue
        todo.append(u)
    if todo:
        ds = ray.data.from_items([{"unit": json.dumps(u)} for u in todo], override_num_blocks=len(todo))
        ds = ds.map(_map, fn_kwargs={"out_dir": out_dir}, num_cpus=num_cpus,
                    compute=ray.data.TaskPoolStrategy(size=min(concurrency, len(todo))))
        for row in ds.iter_rows():
            sc = json.loads(row["sidecar"])
            done[unit_name(sc["split"], sc["index"])] = sc
    return done
