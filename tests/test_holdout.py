"""Train-only ImageFolder sources: a seeded, stratified hold-out as the val split, recorded with the run."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from PIL import Image

from lightray.data.source import DEFAULT_VAL_FRACTION, DataError, list_imagefolder, run_val_fraction

ROOT = pathlib.Path(__file__).parents[1]


def _train_only(root: pathlib.Path, counts: dict[str, int], size: int = 8) -> pathlib.Path:
    for c, (name, n) in enumerate(sorted(counts.items())):
        folder = root / "train" / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.new("RGB", (size, size), (40 * c % 256, 7 * i % 256, 90)).save(folder / f"{i:03d}.jpg", "JPEG")
    return root


def test_holdout_is_stratified_disjoint_and_recorded(tmp_path):
    root = _train_only(tmp_path / "ds", {"a": 10, "b": 20, "c": 7})
    listing = list_imagefolder(str(root), 0.2, seed=3)
    train, val = listing.splits["train"], listing.splits["val"]
    per_class = {name: sum(e.label == i for e in val) for i, name in enumerate(listing.classes)}
    assert per_class == {"a": 2, "b": 4, "c": 1}  # round(0.2 * n) of every class
    assert not {e.path for e in train} & {e.path for e in val}
    assert len(train) + len(val) == 37 and all(e.path.startswith("train/") for e in val)
    assert [e.path for e in val] == sorted(e.path for e in val)
    assert listing.holdout["val_fraction"] == 0.2 and listing.holdout["seed"] == 3
    assert listing.holdout["train_val_per_class"] == {"a": [8, 2], "b": [16, 4], "c": [6, 1]}


def test_holdout_is_deterministic_for_a_seed_and_changes_the_cache_key(tmp_path):
    root = str(_train_only(tmp_path / "ds", {"a": 12, "b": 12}))
    one, again = list_imagefolder(root, 0.25, 1), list_imagefolder(root, 0.25, 1)
    other = list_imagefolder(root, 0.25, 2)
    assert one.splits == again.splits and one.fingerprint() == again.fingerprint()
    assert one.holdout["val_paths_sha256"] == again.holdout["val_paths_sha256"]
    assert {e.path for e in one.splits["val"]} != {e.path for e in other.splits["val"]}
    assert one.fingerprint() != other.fingerprint() != list_imagefolder(root).fingerprint()


@pytest.mark.parametrize("counts, fraction, name, n", [({"a": 10, "tiny": 1}, 0.5, "tiny", 1),
                                                       ({"a": 10, "few": 4}, 0.1, "few", 4)])
def test_class_too_small_for_a_holdout_names_the_class_and_counts(tmp_path, counts, fraction, name, n):
    root = _train_only(tmp_path / "ds", counts)
    with pytest.raises(DataError, match=rf"train/{name}: class '{name}' has {n} image\(s\)"):
        list_imagefolder(str(root), fraction, 0)


def test_val_fraction_with_a_val_folder_is_an_error_and_the_run_rule(tmp_path):
    root = _train_only(tmp_path / "ds", {"a": 10})
    assert "val" not in list_imagefolder(str(root)).splits  # a library listing with 0 stays as it is
    assert run_val_fraction(str(root), 0.0) == DEFAULT_VAL_FRACTION and run_val_fraction(str(root), 0.3) == 0.3
    (root / "val" / "a").mkdir(parents=True)
    Image.new("RGB", (8, 8), (1, 2, 3)).save(root / "val" / "a" / "v.jpg", "JPEG")
    assert run_val_fraction(str(root), 0.0) == 0.0
    with pytest.raises(DataError, match="has a val/ split, so data.val_fraction=0.2"):
        list_imagefolder(str(root), 0.2, 0)


# --- container sources: Parquet rows (stratified, by row path) and WebDataset keys (per row, by key path) -------
def test_parquet_holdout_is_stratified_disjoint_seeded_and_keyed(tmp_path):
    from lightray.data.sources import list_source
    from lightray.data.sources_parquet import plan_units
    from tests.test_source_order import make_hf_parquet

    make_hf_parquet(tmp_path / "pq", per_class=40, sort=True, files=2, val_per_class=0)
    for p in (tmp_path / "pq" / "data").glob("validation-*"):
        p.unlink()
    a, b = list_source(str(tmp_path / "pq"), 0.25, 1), list_source(str(tmp_path / "pq"), 0.25, 2)
    val, train = a.picked["val"], a.picked["train"]
    assert len(val) == 30 and len(train) == 90 and not set(val) & set(train)
    assert a.holdout["train_val_per_class"] == {"ant": [30, 10], "bee": [30, 10], "cow": [30, 10]}
    assert not np.array_equal(val, b.picked["val"])  # the seed decides which rows
    assert np.array_equal(val, list_source(str(tmp_path / "pq"), 0.25, 1).picked["val"])
    assert a.fingerprint() != b.fingerprint() != list_source(str(tmp_path / "pq")).fingerprint()
    rows = {(p["file_index"], r) for u in plan_units(a, "val", 0, 8) for p in u.get("parts", [u])
            for r in (range(*p["range"]) if "range" in p else p["take"])}
    assert rows == {(int(i >= 60), int(i % 60)) for i in val}  # the val split reads exactly the held-out rows


def test_parquet_holdout_with_a_validation_split_is_an_error_only_when_asked_for(tmp_path):
    from lightray.data.sources import list_source
    from tests.test_source_order import make_hf_parquet

    make_hf_parquet(tmp_path / "pq", per_class=10, sort=False)
    with pytest.raises(DataError, match=r"has a validation split, so data.val_fraction=0.2 has nothing to do"):
        list_source(str(tmp_path / "pq"), 0.2, 0)
    listing = list_source(str(tmp_path / "pq"), 0.1, 0, explicit=False)  # a run's default: the split is used
    assert listing.holdout is None and listing.num_files("val") == 60


def test_webdataset_holdout_takes_each_key_to_one_side(tmp_path, ray_local):
    import pyarrow.parquet as pq

    from lightray.data.manifest import Manifest
    from lightray.data.prepare import prepare
    from tests.test_sources import make_webdataset

    make_webdataset(tmp_path / "wds", per_tar=40)
    for p in (tmp_path / "wds").glob("val-*"):
        p.unlink()
    man = Manifest.load(str(prepare(str(tmp_path / "wds"), str(tmp_path / "cache"), [32], val_fraction=0.25)))
    ids = {s: {i for sh in man.shards(s, 32) for i in pq.read_table(sh.uri)["sample_id"].to_pylist()}
           for s in ("train", "val")}
    assert not ids["train"] & ids["val"] and len(ids["train"] | ids["val"]) == 79  # 80 keys, one an error page
    assert 8 <= len(ids["val"]) <= 32 and man.data["holdout"]["val_fraction"] == 0.25
