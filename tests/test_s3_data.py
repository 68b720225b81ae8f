"""Data on object storage for real: an ImageFolder tree of real JPEGs and a Parquet source uploaded to a local
S3 API server (moto's ThreadedMotoServer), reached through pyarrow's S3FileSystem with ``endpoint_override``
in the URI. Listing, prepare into a shard cache on s3:// (and its resume after an interrupted build), the
``--prepare-only`` command line with ``--data s3://...``, and node-local copies of s3 shards under a disk
budget."""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from bench.pipeline import make_source
from lightray import storage
from lightray.data import shard_cache
from lightray.data.ingest import IngestSpec, PhaseSpec, phase_blocks, tier_shards, train_block_batch
from lightray.data.manifest import Manifest
from lightray.data.prepare import prepare
from lightray.data.source import detect_kind, list_imagefolder
from lightray.data.sources_rows import ROW_BITS
from tests.conftest import S3_ENV, start_session_ray
from tests.test_sources import check_cache, make_parquet

REPO = pathlib.Path(__file__).resolve().parents[1]
BUCKET = "lightray-data"
TIERS = [16, 24]


@pytest.fixture(scope="module")
def s3_query():
    """A moto S3 server for the module, with credentials in the environment before any Ray worker starts
    (workers inherit it); yields the URI query string that points pyarrow at the server."""
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in S3_ENV.items():
            mp.setenv(k, v)
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            import pyarrow.fs as pafs

            pafs.S3FileSystem(endpoint_override=f"{host}:{port}", scheme="http", region="us-east-1",
                              allow_bucket_creation=True).create_dir(BUCKET)
            yield f"?endpoint_override={host}:{port}&scheme=http&region=us-east-1"
        finally:
            server.stop()


def s3_uri(query: str, *parts: str) -> str:
    return storage.join(f"s3://{BUCKET}{query}", *parts)


def upload(local: pathlib.Path, uri: str) -> str:
    """Put every file under ``local`` at the same relative path under ``uri`` (one PUT each)."""
    for p in sorted(local.rglob("*")):
        if p.is_file():
            storage.write_bytes(storage.join(uri, p.relative_to(local).as_posix()), p.read_bytes())
    return uri


@pytest.fixture(scope="module")
def tree(s3_query, tmp_path_factory) -> tuple[pathlib.Path, str]:
    """The same ImageFolder tree on local disk and on s3."""
    local = make_source(tmp_path_factory.mktemp("s3data") / "src", n_train=48, n_val=12, classes=3, size=(40, 30))
    return local, upload(local, s3_uri(s3_query, "imagefolder"))


@pytest.fixture(scope="module")
def cluster(s3_query):
    start_session_ray()


def test_an_imagefolder_tree_on_s3_lists_like_the_same_tree_on_disk(tree):
    local, uri = tree
    remote, here = list_imagefolder(uri), list_imagefolder(str(local))
    assert detect_kind(uri) == "imagefolder"
    assert remote.root == uri and remote.classes == here.classes == ["c0", "c1", "c2"]
    for split in ("train", "val"):  # same order, so the same sample ids
        assert [(e.path, e.size, e.label) for e in remote.splits[split]] == \
            [(e.path, e.size, e.label) for e in here.splits[split]]


@pytest.fixture(scope="module")
def parquet_on_s3(s3_query, tmp_path_factory) -> tuple[dict[str, list], str]:
    """The Hugging Face layout of tests/test_sources.py (one truncated JPEG among its rows), on s3."""
    local = tmp_path_factory.mktemp("s3pq") / "pq"
    expected = make_parquet(local)
    return expected, upload(local, s3_uri(s3_query, "parquet"))


def test_a_parquet_source_on_s3_prepares_into_an_s3_cache(parquet_on_s3, cluster, s3_query):
    expected, data = parquet_on_s3
    assert detect_kind(data) == "parquet"
    out = str(prepare(data, s3_uri(s3_query, "cache-pq"), [32, 48], raw_max_resolution=64, shard_rows=4))
    assert out.startswith(f"s3://{BUCKET}/cache-pq/") and out.endswith(s3_query)
    man = check_cache(out, expected, (1 << ROW_BITS) | 3, "truncated")  # reads every shard back from s3
    assert man.bad_files()[0]["path"] == "data/train-00001-of-00002.parquet#3"


def test_class_sorted_tars_on_s3_are_remixed_as_the_same_tars_on_disk(cluster, s3_query, tmp_path):
    # One tar per class (a writer walking class folders in order): the order of rows never changes what a
    # run learns, wherever the tars lie.
    from tests.test_source_order import make_class_tars

    make_class_tars(tmp_path / "wds", per_class=40)
    uri = upload(tmp_path / "wds", s3_uri(s3_query, "wds-sorted"))
    labels = {}
    for where, src in (("disk", str(tmp_path / "wds")), ("s3", uri)):
        man = Manifest.load(str(prepare(src, str(tmp_path / f"cache-{where}"), [32], raw_max_resolution=64,
                                        shard_rows=30)))
        labels[where] = [pq.read_table(sh.uri)["label"].to_pylist() for sh in man.shards("train", 32)]
    assert labels["s3"] == labels["disk"] and len(labels["s3"]) == 4
    for shard in labels["s3"]:
        assert min(np.bincount(shard, minlength=3)) >= 5, shard  # each shard a fair sample of the 3 classes


@pytest.mark.slow  # a driver process that starts its own Ray cluster: 60-110 s on a loaded 2-core machine
@pytest.mark.shares_cpu
def test_prepare_only_with_data_on_s3_prints_the_s3_cache(parquet_on_s3, s3_query, tmp_path):
    expected, data = parquet_on_s3
    cache = s3_uri(s3_query, "cache-cli")
    out = subprocess.run(
        [sys.executable, "app/run.py", "--prepare-only", "--data", data, f"--data.cache_dir={cache}",
         "--data.tiers=[32, 48]", "--data.raw_max_resolution=64", "--data.shard_rows=4", "--storage", str(tmp_path),
         "--scaling.ray_address=local", "--scaling.ray_num_cpus=2"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **S3_ENV})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    location = out.stdout.strip().splitlines()[-1]
    assert location.startswith(f"s3://{BUCKET}/cache-cli/") and location.endswith(s3_query)
    check_cache(location, expected, (1 << ROW_BITS) | 3, "truncated")


@pytest.fixture(scope="module")
def s3_cache(tree, cluster, s3_query) -> str:
    return str(prepare(tree[1], s3_uri(s3_query, "cache"), TIERS, raw_max_resolution=16, shard_rows=16))


def test_prepare_from_s3_writes_its_cache_on_s3(tree, s3_cache):
    man = Manifest.load(s3_cache)
    assert s3_cache.startswith(f"s3://{BUCKET}/cache/")
    assert man.num_samples("train") == 48 and man.num_samples("val") == 12
    listing = list_imagefolder(tree[0])
    want = {i: e.label for i, e in enumerate(listing.splits["train"])}
    for tier in TIERS:
        rows = [r for s in man.shards("train", tier) for r in pq.read_table(s.uri, columns=["sample_id", "label"])
                .to_pylist()]
        assert {r["sample_id"]: r["label"] for r in rows} == want


def test_node_local_copies_of_s3_shards_stay_within_the_disk_budget(s3_cache, tmp_path):
    man = Manifest.load(s3_cache)
    tier = tier_shards(man, "train", 24)
    sizes = [s.bytes for s in man.shards("train", 24)]
    budget = int(1.5 * max(sizes))  # room for one shard: every new shard evicts the last
    local = tmp_path / "nvme"
    spec = IngestSpec(seed=2, local_dir=str(local), train_size=man.num_samples("train"),
                      phases=[PhaseSpec(0, 24, 16, 0.35, 0, 1, tier)], val=tier, eval_resolution=24,
                      val_crop_ratio=0.875, block_rows=48, local_max_bytes=budget)
    shard_cache._OPEN.clear()
    for k in shard_cache.STATS:
        shard_cache.STATS[k] = 0
    blocks = phase_blocks(spec, 0, 0, 0)
    out = train_block_batch({k: np.array([b[k] for b in blocks]) for k in ("epoch", "step0", "nsteps")},
                            spec=spec, phase=0, rank=0, world_size=1)
    assert sorted(out["sample_id"].tolist()) == list(range(48)) and out["image"].shape[1:] == (24, 24, 3)
    assert shard_cache.STATS["copied"] == len(sizes) and shard_cache.STATS["evicted"] == len(sizes) - 1
    left = [p for p in local.glob("??/*.parquet")]
    assert len(left) == 1 and sum(p.stat().st_size for p in left) <= budget


def test_an_interrupted_prepare_on_s3_rebuilds_only_the_missing_shard(tree, s3_cache, s3_query, caplog):
    before = Manifest.load(s3_cache)
    fs, base = storage.resolve_fs(s3_cache)
    stamps = {i.base_name: i.mtime_ns for i in storage.list_dir(base, detail=True, fs=fs) if i.is_file}
    lost = "train-24-00001.parquet"
    assert lost in stamps and None not in stamps.values()
    time.sleep(1.5)  # S3 modification times have one-second resolution: a rewrite must show a new one
    # What a prepare killed after writing some shards leaves: no manifest, a shard missing.
    storage.remove(f"{base}/manifest.json", fs=fs)
    storage.remove(f"{base}/{lost}", fs=fs)
    caplog.set_level(logging.INFO, logger="lightray.prepare")
    again = str(prepare(tree[1], s3_uri(s3_query, "cache"), TIERS, raw_max_resolution=16, shard_rows=16))
    assert again == s3_cache
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert "3 of 4 shards already built, 1 to build" in log and "1 shards built, 3 reused" in log, log
    after = {i.base_name: i.mtime_ns for i in storage.list_dir(base, detail=True, fs=fs)}
    rebuilt = {n for n in stamps if n.endswith(".parquet") and after.get(n) != stamps[n]}
    assert rebuilt == {"train-16-00001.parquet", lost}  # the shard's unit writes both of its tiers again
    man = Manifest.load(again)
    for split in ("train", "val"):
        for tier in TIERS:
            assert [s.sha256 for s in man.shards(split, tier)] == [s.sha256 for s in before.shards(split, tier)]
