"""The disk budget of the node-local shard copies (``data.local_cache_max_gb``), on real Parquet shard files
copied by real processes: least-recently-used eviction, recency refreshed by use, a shard larger than the
budget, a copy evicted while memory-mapped, concurrent evictors, and the budget reaching the copies that
the ingest's map function makes."""

from __future__ import annotations

import gc
import hashlib
import logging
import mmap
import multiprocessing
import pathlib
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightray.config import ConfigError, load_config
from lightray.data import shard_cache
from lightray.data.ingest import IngestSpec, PhaseSpec, TierShards, phase_blocks, train_block_batch

SIDE = 32  # raw rows of SIDE x SIDE x 3 random pixels: incompressible, so a shard's size is predictable
ROWS = 8


def write_shard(path: pathlib.Path, seed: int, rows: int = ROWS) -> dict:
    """A real shard file in the cache's schema (raw pixels); returns its uri, sha256, size and pixels."""
    rng = np.random.default_rng(seed)
    pixels = [rng.integers(0, 256, SIDE * SIDE * 3, dtype=np.uint8).tobytes() for _ in range(rows)]
    table = pa.table({"sample_id": pa.array(range(seed * 100, seed * 100 + rows), pa.int64()),
                      "label": pa.array([seed % 3] * rows, pa.int32()), "image": pa.array(pixels, pa.binary()),
                      "height": pa.array([SIDE] * rows, pa.int32()), "width": pa.array([SIDE] * rows, pa.int32())})
    pq.write_table(table, path, compression="NONE")
    data = path.read_bytes()
    return {"uri": str(path), "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "pixels": pixels}


@pytest.fixture
def shards(tmp_path) -> list[dict]:
    shared = tmp_path / "shared"
    shared.mkdir()
    return [write_shard(shared / f"train-32-{i:05d}.parquet", i) for i in range(8)]


@pytest.fixture(autouse=True)
def fresh_stats():
    shard_cache._OPEN.clear()
    shard_cache._TOUCHED.clear()
    for k in shard_cache.STATS:
        shard_cache.STATS[k] = 0


def cached(local: pathlib.Path) -> dict[str, int]:
    return {p.stem: p.stat().st_size for p in local.glob("??/*.parquet")}


def test_least_recently_used_copies_are_evicted_first_and_a_use_refreshes_recency(shards, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lightray.data.shard_cache")
    local = tmp_path / "nvme"
    a, b, c, d = shards[:4]
    budget = int(2.5 * a["bytes"])  # room for two copies
    for s in (a, b):
        shard_cache.local_copy(s["uri"], s["sha256"], str(local), budget)
        time.sleep(0.02)  # distinct recency stamps on file systems with coarse timestamps
    assert shard_cache.local_copy(a["uri"], a["sha256"], str(local), budget)  # a used again: now b is the oldest
    time.sleep(0.02)
    shard_cache.local_copy(c["uri"], c["sha256"], str(local), budget)
    assert set(cached(local)) == {a["sha256"], c["sha256"]}
    assert (shard_cache.STATS["copied"], shard_cache.STATS["local_hits"], shard_cache.STATS["evicted"]) == (3, 1, 1)
    assert any("evicted" in r.getMessage() and b["sha256"] in r.getMessage() for r in caplog.records)

    time.sleep(0.02)
    shard_cache.local_copy(d["uri"], d["sha256"], str(local), budget)  # a is the oldest now
    assert set(cached(local)) == {c["sha256"], d["sha256"]}
    assert sum(cached(local).values()) <= budget


def test_no_budget_keeps_every_copy(shards, tmp_path):
    local = tmp_path / "nvme"
    for s in shards:
        shard_cache.local_copy(s["uri"], s["sha256"], str(local))
    assert len(cached(local)) == len(shards) and shard_cache.STATS["evicted"] == 0


def test_a_shard_larger_than_the_budget_is_still_copied_with_a_warning(shards, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lightray.data.shard_cache")
    local = tmp_path / "nvme"
    small = shards[0]
    big = write_shard(tmp_path / "shared" / "train-32-big.parquet", 99, rows=4 * ROWS)
    budget = int(1.5 * small["bytes"])
    shard_cache.local_copy(small["uri"], small["sha256"], str(local), budget)
    path = shard_cache.local_copy(big["uri"], big["sha256"], str(local), budget)
    assert shard_cache.sha256_file(path) == big["sha256"]
    assert set(cached(local)) == {big["sha256"]}  # everything else made way for it
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("larger than the whole budget" in w and "copying it anyway" in w for w in warnings), warnings


def test_a_copy_evicted_while_memory_mapped_stays_readable(shards, tmp_path):
    local = tmp_path / "nvme"
    a, others = shards[0], shards[1:4]
    budget = int(1.5 * a["bytes"])
    table = shard_cache.open_table(a["uri"], a["sha256"], str(local), ["image"], budget)
    for s in others:
        shard_cache.open_table(s["uri"], s["sha256"], str(local), ["image"], budget)
    assert a["sha256"] not in cached(local)  # unlinked ...
    assert table.column("image").to_pylist() == a["pixels"]  # ... and still read through the open mapping


def test_the_most_used_shard_survives_eviction_when_its_reads_come_from_the_open_shards(shards, tmp_path):
    local = tmp_path / "nvme"
    hot, b, c, d = shards[:4]
    budget = int(3.5 * hot["bytes"])  # room for three copies
    shard_cache.parquet_shard(hot["uri"], hot["sha256"], "raw", str(local), budget)  # copied first: the oldest
    for s in (b, c):
        time.sleep(0.02)
        shard_cache.local_copy(s["uri"], s["sha256"], str(local), budget)
    time.sleep(0.02)
    for _ in range(5):  # every read of the hot shard is served by this process's open shards
        shard_cache.parquet_shard(hot["uri"], hot["sha256"], "raw", str(local), budget)
    assert shard_cache.STATS["memory_hits"] == 5
    shard_cache._OPEN.clear()  # the process lets go of its maps: recency alone decides now
    gc.collect()
    time.sleep(0.02)
    shard_cache.local_copy(d["uri"], d["sha256"], str(local), budget)
    assert set(cached(local)) == {hot["sha256"], c["sha256"], d["sha256"]}  # b, the least used, went


def test_a_mapped_copy_goes_last_and_a_mapped_copy_already_unlinked_still_counts(shards, tmp_path):
    local = tmp_path / "nvme"
    a, b, c, d = shards[:4]
    budget = int(2.5 * a["bytes"])  # room for two copies
    # The oldest copy, mapped by a reader (one in the middle of a read, or one reading it in place).
    path = shard_cache.local_copy(a["uri"], a["sha256"], str(local), budget)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    assert shard_cache.mapped_copies(str(local)) == ({path}, 0)
    time.sleep(0.02)
    shard_cache.local_copy(b["uri"], b["sha256"], str(local), budget)
    time.sleep(0.02)
    shard_cache.local_copy(c["uri"], c["sha256"], str(local), budget)
    assert set(cached(local)) == {a["sha256"], c["sha256"]}  # b went although a was older: a is in use

    # Another evictor (another node sharing the folder) unlinks a while it is mapped: its blocks stay on disk.
    next(local.glob(f"??/{a['sha256']}.parquet")).unlink()
    _live, held = shard_cache.mapped_copies(str(local))
    assert held >= a["bytes"]
    shard_cache.local_copy(b["uri"], b["sha256"], str(local), budget)  # c and b fit, a's blocks aside
    time.sleep(0.02)
    shard_cache.local_copy(d["uri"], d["sha256"], str(local), budget)
    assert set(cached(local)) == {d["sha256"]}  # c and b made way: a's blocks still count against the budget
    assert hashlib.sha256(mapped[:]).hexdigest() == a["sha256"]  # the reader still has all of a
    mapped.close()
    assert shard_cache.mapped_copies(str(local)) == (set(), 0)


READS = 60


def _reader(args: tuple) -> tuple[int, int]:
    """One process reading random shards through a tight budget; returns (rows checked, copies it evicted)."""
    worker, local, budget, shards = args
    shard_cache._OPEN.clear()
    shard_cache.STATS["evicted"] = 0
    rng = np.random.default_rng(worker)
    checked = 0
    for i in rng.integers(0, len(shards), READS).tolist():
        s = shards[i]
        table = shard_cache.open_table(s["uri"], s["sha256"], local, ["image"], budget)
        assert table.column("image").to_pylist() == s["pixels"]
        checked += table.num_rows
    return checked, shard_cache.STATS["evicted"]


@pytest.mark.slow  # concurrent processes
@pytest.mark.shares_cpu
def test_concurrent_evictors_never_fail_each_other_and_end_within_the_budget(shards, tmp_path):
    local = tmp_path / "nvme"
    # Fewer shards fit than there are readers, so copies are evicted between another reader's copy and open.
    budget = int(1.5 * shards[0]["bytes"])
    ctx = multiprocessing.get_context("fork")  # separate processes, like Ray workers on one node
    with ctx.Pool(6) as pool:
        results = pool.map(_reader, [(w, str(local), budget, shards) for w in range(6)])
    assert [r[0] for r in results] == [READS * ROWS] * 6
    assert sum(r[1] for r in results) > 0  # the budget was really contended
    assert sum(cached(local).values()) <= budget
    assert not [p for p in local.rglob("*") if ".tmp" in p.name]  # no half-copied file left behind


def test_the_budget_reaches_the_copies_the_ingest_map_makes(shards, tmp_path):
    local = tmp_path / "nvme"
    budget = int(2.5 * shards[0]["bytes"])
    tier = TierShards(SIDE, "raw", [s["uri"] for s in shards], [s["sha256"] for s in shards], [ROWS] * len(shards))
    spec = IngestSpec(seed=1, local_dir=str(local), train_size=ROWS * len(shards),
                      phases=[PhaseSpec(0, 16, ROWS, 0.35, 0, 1, tier)], val=tier, eval_resolution=16,
                      val_crop_ratio=0.875, block_rows=ROWS * len(shards), local_max_bytes=budget)
    blocks = phase_blocks(spec, 0, 0, 0)
    out = train_block_batch({k: np.array([b[k] for b in blocks]) for k in ("epoch", "step0", "nsteps")},
                            spec=spec, phase=0, rank=0, world_size=1)
    assert sorted(out["sample_id"].tolist()) == sorted(i * 100 + r for i in range(len(shards)) for r in range(ROWS))
    assert shard_cache.STATS["evicted"] >= len(shards) - 2
    assert sum(cached(local).values()) <= budget


def test_local_cache_max_gb_is_a_config_key_and_zero_means_unlimited():
    assert load_config("demo", {"data.local_cache_max_gb": "0.5"}).data.local_cache_max_gb == 0.5
    assert load_config("demo").data.local_cache_max_gb == 0  # unlimited by default
    with pytest.raises(ConfigError, match="data.local_cache_max_gb"):
        load_config("demo", {"data.local_cache_max_gb": "-1"})
