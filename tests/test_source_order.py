"""The order of rows in a source never changes what a run learns: a Parquet file sorted by class (the
Hugging Face layout of a dataset built from class folders) is cut into shards that are fair samples, and
trains as well as the same rows shuffled; a shuffled source keeps its sequential row ranges."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lightray.data import mix
from lightray.data.manifest import Manifest
from lightray.data.prepare import prepare
from lightray.data.sources import list_source
from lightray.data.sources_parquet import plan_units
from tests.test_sources import CLASSES, HF_META, jpeg

REPO = pathlib.Path(__file__).resolve().parents[1]


def make_hf_parquet(root: pathlib.Path, per_class: int, sort: bool, files: int = 1, val_per_class: int = 20,
                    row_group_size: int = 50) -> None:
    """``data/train-*.parquet`` (rows in class order when ``sort``, else shuffled) and a shuffled validation file;
    real JPEGs whose dominant colour channel is the label."""
    rng = np.random.default_rng(0)
    (root / "data").mkdir(parents=True)
    for split, n, parts in (("train", per_class, files), ("validation", val_per_class, 1)):
        labels = np.repeat(np.arange(len(CLASSES)), n)
        if split == "validation" or not sort:
            labels = rng.permutation(labels)
        for fi, chunk in enumerate(np.array_split(labels, parts)):
            image = pa.array([{"bytes": jpeg(int(lab), rng), "path": f"{CLASSES[lab]}/{i}.jpg"}
                              for i, lab in enumerate(chunk)],
                             pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
            table = pa.table({"image": image, "label": pa.array(chunk, pa.int64())}).replace_schema_metadata(HF_META)
            pq.write_table(table, root / "data" / f"{split}-{fi:05d}-of-{parts:05d}.parquet",
                           row_group_size=row_group_size)


def test_clustering_separates_class_sorted_labels_from_shuffled_ones():
    rng = np.random.default_rng(0)
    for classes, n in ((3, 60), (10, 50_000), (1000, 100_000)):
        shuffled = [mix.clustering(rng.integers(0, classes, n)) for _ in range(20)]
        assert max(shuffled) < mix.LIMIT, (classes, n, shuffled)
        assert mix.clustering(np.sort(rng.integers(0, classes, n))) > 2 * mix.LIMIT
    assert mix.clustering(np.zeros(5000, np.int64)) == 0.0  # one class: nothing to mix


def test_a_shuffled_parquet_source_keeps_row_ranges_of_one_file(tmp_path):
    make_hf_parquet(tmp_path / "pq", per_class=40, sort=False, files=2)
    listing = list_source(str(tmp_path / "pq"))
    assert "mixed_splits" not in listing.options
    units = plan_units(listing, "train", 0, 16)
    assert all("parts" not in u and "range" in u for u in units)
    assert sum(u["listed"] for u in units) == 120


def test_class_sorted_parquet_units_take_every_row_once_across_files(tmp_path):
    make_hf_parquet(tmp_path / "pq", per_class=40, sort=True, files=2)
    listing = list_source(str(tmp_path / "pq"))
    assert listing.options["mixed_splits"] == ["train"]
    units = plan_units(listing, "train", 0, 16)
    rows = [(p["file_index"], r) for u in units for p in u["parts"]
            for r in (range(*p["range"]) if "range" in p else p["take"])]
    assert sorted(rows) == [(fi, r) for fi in (0, 1) for r in range(60)]
    assert sum(len(u["parts"]) == 2 for u in units) >= len(units) // 2  # units read from both files


def test_class_sorted_parquet_is_cut_into_shards_that_each_hold_every_class(tmp_path, ray_cluster):
    make_hf_parquet(tmp_path / "pq", per_class=80, sort=True)
    out = prepare(str(tmp_path / "pq"), str(tmp_path / "cache"), [32], raw_max_resolution=64, shard_rows=30)
    man = Manifest.load(str(out))
    shards = man.shards("train", 32)
    assert len(shards) == 8
    seen = {}
    for s in shards:
        table = pq.read_table(s.uri)
        counts = np.bincount(table["label"].to_numpy(), minlength=3)
        assert counts.min() >= 4, f"shard {s.uri} holds classes {counts.tolist()}: not a fair sample"
        for sid, lab, img, h, w in zip(*(table[c].to_pylist() for c in ("sample_id", "label", "image", "height",
                                                                         "width"))):
            px = np.frombuffer(img, np.uint8).reshape(h, w, 3)
            assert int(np.argmax(px.reshape(-1, 3).mean(0))) == lab  # the row's own picture and label
            seen[sid] = lab
    assert sorted(seen) == list(range(240))  # every row once, ids stable (file 0, row r)
    assert [seen[r] for r in range(240)] == [r // 80 for r in range(240)]


def test_a_class_sorted_parquet_on_s3_is_mixed_as_on_disk(tmp_path, s3_storage):
    from tests.test_s3_data import upload

    make_hf_parquet(tmp_path / "pq", per_class=40, sort=True)
    uri = upload(tmp_path / "pq", s3_storage.replace("/runs?", "/pq?"))
    here, remote = list_source(str(tmp_path / "pq")), list_source(uri)
    assert remote.options == here.options and here.options["mixed_splits"] == ["train"]
    assert plan_units(remote, "train", 0, 16) == plan_units(here, "train", 0, 16)


def make_class_tars(root: pathlib.Path, per_class: int, corrupt: bool = False) -> None:
    """One tar per class, the way a writer walking class folders in order makes them, and a shuffled val tar."""
    import io
    import tarfile

    rng = np.random.default_rng(2)
    root.mkdir(parents=True)
    val = rng.permutation(np.repeat(np.arange(len(CLASSES)), 20))
    for name, labels in [(f"train-{c:05d}", [c] * per_class) for c in range(len(CLASSES))] + [("val-00000", val)]:
        with tarfile.open(root / f"{name}.tar", "w") as tar:
            for i, lab in enumerate(labels):
                blob = jpeg(int(lab), rng)
                if corrupt and name == "train-00001" and i == 3:
                    blob = b"<html>403</html>"
                for ext, data in (("jpg", blob), ("cls", str(int(lab)).encode())):
                    info = tarfile.TarInfo(f"{name}_{i:04d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    (root / "classes.json").write_text(json.dumps(list(CLASSES)))


def test_class_sorted_tars_are_remixed_into_shards_that_each_hold_every_class(tmp_path, ray_cluster):
    make_class_tars(tmp_path / "wds", per_class=80, corrupt=True)
    out = prepare(str(tmp_path / "wds"), str(tmp_path / "cache"), [32, 48], raw_max_resolution=64, shard_rows=30)
    man = Manifest.load(str(out))
    assert man.num_samples("train") == 239
    assert [b["path"] for b in man.bad_files()] == ["train-00001.tar#train-00001_0003"]
    ids_at = {}
    for t in (32, 48):
        shards = man.shards("train", t)
        assert len(shards) == 8
        for s in shards:
            table = pq.read_table(s.uri)
            counts = np.bincount(table["label"].to_numpy(), minlength=3)
            assert counts.min() >= 4, f"shard {s.uri} holds classes {counts.tolist()}: not a fair sample"
        ids_at[t] = [pq.read_table(s.uri)["sample_id"].to_pylist() for s in shards]
    assert ids_at[32] == ids_at[48]  # row i of shard j is one sample at every tier
    assert man.native_short_side is not None and 40 <= man.native_short_side <= 119
    # Built once: the same tars again are a cache hit.
    assert prepare(str(tmp_path / "wds"), str(tmp_path / "cache"), [32, 48], raw_max_resolution=64,
                   shard_rows=30) == out
