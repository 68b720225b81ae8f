"""Parquet and WebDataset sources on small real files: labels, class names, bad rows, and a smoke run."""

from __future__ import annotations

import io
import json
import pathlib
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from lightray.data.manifest import Manifest
from lightray.data.prepare import prepare
from lightray.data.source import DataError, detect_kind
from lightray.data.sources import list_source
from lightray.data.sources_rows import ROW_BITS

REPO = pathlib.Path(__file__).resolve().parents[1]
CLASSES = ("ant", "bee", "cow")
TIERS = [32, 48]


def jpeg(label: int, rng: np.random.Generator) -> bytes:
    """A real JPEG whose dominant colour channel is its label."""
    h, w = int(rng.integers(40, 120)), int(rng.integers(40, 120))
    arr = np.zeros((h, w, 3), np.uint8)
    arr[..., label] = 200
    arr += (rng.random((h, w, 3)) * 40).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def labels_of(n: int, offset: int) -> list[int]:
    return [(i + offset) % len(CLASSES) for i in range(n)]


HF_META = {b"huggingface": json.dumps({"info": {"features": {
    "image": {"_type": "Image"}, "label": {"names": list(CLASSES), "_type": "ClassLabel"}}}}).encode()}


def make_parquet(root: pathlib.Path, string_labels: bool = False, per_file: int = 10) -> dict[str, list]:
    """HF layout: data/{train-0000k-of-00002,validation-00000-of-00001}.parquet; train file 1 row 3 corrupt.
    Returns the expected label per (split, file index) row."""
    rng = np.random.default_rng(0)
    (root / "data").mkdir(parents=True)
    expected: dict[str, list] = {}
    for split, files in (("train", 2), ("validation", 1)):
        for fi in range(files):
            labels = labels_of(per_file, fi)
            blobs = [jpeg(lab, rng) for lab in labels]
            if split == "train" and fi == 1:
                blobs[3] = blobs[3][: len(blobs[3]) // 2]  # truncated JPEG
            if string_labels:
                table = pa.table({"img_bytes": pa.array(blobs, pa.binary()),
                                  "label": pa.array([CLASSES[lab] for lab in labels])})
            else:
                image = pa.array([{"bytes": b, "path": f"{i}.jpg"} for i, b in enumerate(blobs)],
                                 pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
                table = pa.table({"image": image, "label": pa.array(labels, pa.int64())})
                table = table.replace_schema_metadata(HF_META)
            pq.write_table(table, root / "data" / f"{split}-{fi:05d}-of-{files:05d}.parquet", row_group_size=4)
            expected.setdefault("val" if split == "validation" else split, []).append(labels)
    return expected


def make_webdataset(root: pathlib.Path, per_tar: int = 10) -> dict[str, list]:
    """train-00000.tar, train-00001.tar, val-00000.tar of key.jpg + key.cls; train tar 0 key 5 corrupt."""
    rng = np.random.default_rng(1)
    root.mkdir(parents=True)
    expected: dict[str, list] = {}
    for split, tars in (("train", 2), ("val", 1)):
        for ti in range(tars):
            labels = labels_of(per_tar, ti)
            with tarfile.open(root / f"{split}-{ti:05d}.tar", "w") as tar:
                for i, lab in enumerate(labels):
                    blob = jpeg(lab, rng)
                    if split == "train" and ti == 0 and i == 5:
                        blob = b"<html>403 Forbidden</html>"  # an error page saved as .jpg
                    for ext, data in (("jpg", blob), ("cls", str(lab).encode())):
                        info = tarfile.TarInfo(f"s{ti}_{i:04d}.{ext}")
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
            expected.setdefault(split, []).append(labels)
    (root / "classes.json").write_text(json.dumps(list(CLASSES)))
    return expected


def check_cache(out: str, expected: dict[str, list], bad_sid: int, bad_reason: str) -> Manifest:
    man = Manifest.load(out)
    assert man.classes == list(CLASSES)
    bad = man.bad_files()
    assert [(b["split"], b["sample_id"]) for b in bad] == [("train", bad_sid)]
    assert bad_reason in bad[0]["reason"]
    for split, files in expected.items():
        want = {(fi << ROW_BITS) | r: lab for fi, labels in enumerate(files) for r, lab in enumerate(labels)}
        if split == "train":
            want.pop(bad_sid)
        assert man.num_samples(split) == len(want)
        for t in TIERS:
            rows = [r for s in man.shards(split, t) for r in pq.read_table(s.uri).to_pylist()]
            assert {r["sample_id"]: r["label"] for r in rows} == want  # ids stable, labels unshifted
            for r in rows:
                img = np.frombuffer(r["image"], np.uint8).reshape(r["height"], r["width"], 3)
                assert min(r["height"], r["width"]) == t
                assert int(np.argmax(img.reshape(-1, 3).mean(0))) == r["label"]  # the right picture
    return man


def test_detects_each_source_kind_from_a_few_listings(tmp_path):
    make_parquet(tmp_path / "pq")
    make_webdataset(tmp_path / "wds")
    (tmp_path / "if" / "train" / "x").mkdir(parents=True)
    assert detect_kind(str(tmp_path / "pq")) == "parquet"
    assert detect_kind(str(tmp_path / "wds")) == "webdataset"
    assert detect_kind(str(tmp_path / "if")) == "imagefolder"


def test_parquet_listing_reads_footers_and_hf_class_names(tmp_path):
    make_parquet(tmp_path / "pq")
    listing = list_source(str(tmp_path / "pq"))
    assert listing.kind == "parquet" and listing.classes == list(CLASSES)
    assert [(f.path, f.num_rows) for f in listing.splits["train"]] == [
        ("data/train-00000-of-00002.parquet", 10), ("data/train-00001-of-00002.parquet", 10)]
    assert listing.num_files("val") == 10
    assert listing.options == {"image_col": "image", "label_col": "label", "label_kind": "int"}


def test_parquet_with_struct_images_prepares_with_stable_ids_and_the_bad_row_listed(tmp_path, ray_cluster):
    expected = make_parquet(tmp_path / "pq")
    out = prepare(str(tmp_path / "pq"), str(tmp_path / "cache"), TIERS, raw_max_resolution=64, shard_rows=4)
    man = check_cache(str(out), expected, (1 << ROW_BITS) | 3, "truncated")
    assert man.bad_files()[0]["path"] == "data/train-00001-of-00002.parquet#3"


def test_parquet_with_string_labels_and_byte_images_takes_sorted_names(tmp_path, ray_cluster):
    expected = make_parquet(tmp_path / "pq", string_labels=True)
    listing = list_source(str(tmp_path / "pq"))
    assert listing.options["image_col"] == "img_bytes" and listing.options["label_kind"] == "str"
    out = prepare(str(tmp_path / "pq"), str(tmp_path / "cache"), TIERS, raw_max_resolution=64, shard_rows=8)
    check_cache(str(out), expected, (1 << ROW_BITS) | 3, "truncated")


def test_parquet_limit_takes_evenly_spaced_rows_of_every_file(tmp_path, ray_cluster):
    make_parquet(tmp_path / "pq")
    out = prepare(str(tmp_path / "pq"), str(tmp_path / "cache"), TIERS, raw_max_resolution=64, shard_rows=4,
                  limit={"train": 5})
    man = Manifest.load(str(out))
    ids = sorted(r for s in man.shards("train", 32) for r in pq.read_table(s.uri)["sample_id"].to_pylist())
    assert ids == [0, 4, 8, (1 << ROW_BITS) | 2, (1 << ROW_BITS) | 6]


def test_webdataset_prepares_with_classes_json_and_the_corrupt_key_listed(tmp_path, ray_cluster):
    expected = make_webdataset(tmp_path / "wds")
    out = prepare(str(tmp_path / "wds"), str(tmp_path / "cache"), TIERS, raw_max_resolution=64)
    man = check_cache(str(out), expected, 5, "not an image")
    assert man.bad_files()[0]["path"] == "train-00000.tar#s0_0005"
    assert man.data["splits"]["train"]["num_listed"] == 20
    # The same tars again: a cache hit (the listing's identity is the tars, not their rows).
    assert prepare(str(tmp_path / "wds"), str(tmp_path / "cache"), TIERS, raw_max_resolution=64) == out


def test_webdataset_without_classes_json_names_classes_by_largest_label(tmp_path, ray_cluster):
    make_webdataset(tmp_path / "wds")
    (tmp_path / "wds" / "classes.json").unlink()
    out = prepare(str(tmp_path / "wds"), str(tmp_path / "cache"), TIERS, raw_max_resolution=64)
    assert Manifest.load(str(out)).classes == ["0", "1", "2"]


def test_source_without_train_split_names_the_root(tmp_path):
    make_parquet(tmp_path / "pq")
    for p in (tmp_path / "pq" / "data").glob("train-*"):
        p.unlink()
    with pytest.raises(DataError, match=f"{tmp_path / 'pq'}: no train Parquet files"):
        list_source(str(tmp_path / "pq"))
