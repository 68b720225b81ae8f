"""list_imagefolder on real folder trees: order, labels, and errors that name the path."""

from __future__ import annotations

import os
import pathlib

import pytest
from PIL import Image

from lightray.data.source import DEFAULT_VAL_FRACTION, DataError, list_imagefolder, run_val_fraction


def _img(path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (1, 2, 3)).save(path, format="JPEG")


def _tree(root: pathlib.Path, spec: dict[str, dict[str, list[str]]]) -> pathlib.Path:
    for split, classes in spec.items():
        for cls, files in classes.items():
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for f in files:
                _img(root / split / cls / f)
    return root


def test_listing_is_sorted_labelled_by_train_class_and_skips_non_images(tmp_path):
    root = _tree(tmp_path / "ds", {"train": {"b_dog": ["2.jpg", "1.JPEG"], "a_cat": ["z.png", "a.jpg"]},
                                   "val": {"b_dog": ["v.jpg"]}})
    (root / "train" / "a_cat" / "notes.txt").write_text("not an image")
    (root / "train" / "a_cat" / ".hidden.jpg").write_bytes(b"")
    (root / "README").write_text("top-level files are not samples")
    listing = list_imagefolder(str(root))
    assert listing.classes == ["a_cat", "b_dog"]
    assert [e.path for e in listing.splits["train"]] == [
        "train/a_cat/a.jpg", "train/a_cat/z.png", "train/b_dog/1.JPEG", "train/b_dog/2.jpg"]
    assert [e.label for e in listing.splits["train"]] == [0, 0, 1, 1]
    assert [(e.path, e.label) for e in listing.splits["val"]] == [("val/b_dog/v.jpg", 1)]  # train's index, not 0
    entry = listing.splits["train"][0]
    assert entry.size == (root / "train/a_cat/a.jpg").stat().st_size and entry.mtime_ns > 0


def test_same_tree_lists_identically_and_file_uri_matches_local_path(tmp_path):
    root = _tree(tmp_path / "ds", {"train": {"x": ["1.jpg", "2.jpg"], "y": ["3.jpg"]}})
    a, b = list_imagefolder(str(root)), list_imagefolder(root.as_uri())
    assert a.splits == b.splits and a.fingerprint() == b.fingerprint()


def test_fingerprint_changes_when_a_file_changes(tmp_path):
    root = _tree(tmp_path / "ds", {"train": {"x": ["1.jpg", "2.jpg"]}})
    before = list_imagefolder(str(root)).fingerprint()
    target = root / "train/x/2.jpg"
    st = target.stat()
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert list_imagefolder(str(root)).fingerprint() != before


def test_missing_root_error_names_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match=str(missing)) as err:
        list_imagefolder(str(missing))
    assert "no such path" in str(err.value)


@pytest.mark.parametrize("split", ["val", "test"])
def test_a_split_folder_without_train_is_refused_naming_train(tmp_path, split):
    root = _tree(tmp_path / "ds", {split: {"x": ["1.jpg"]}})
    with pytest.raises(DataError, match=str(root / "train")) as err:
        list_imagefolder(str(root))
    assert f"the source has {split}/ but no train/" in str(err.value)


def test_a_folder_of_class_folders_is_the_train_split_and_holds_out_a_seeded_val(tmp_path):
    # torchvision's ImageFolder layout: the root holds the class folders, with no split folders.
    root = _tree(tmp_path, {"ds": {"b_dog": [f"{i}.jpg" for i in range(5)], "a_cat": [f"{i}.jpg" for i in range(5)]}})
    root = root / "ds"
    assert run_val_fraction(str(root), 0.0) == DEFAULT_VAL_FRACTION
    whole = list_imagefolder(str(root))
    assert whole.classes == ["a_cat", "b_dog"] and set(whole.splits) == {"train"}
    assert [e.path for e in whole.splits["train"]][:2] == ["a_cat/0.jpg", "a_cat/1.jpg"]
    held = list_imagefolder(str(root), val_fraction=0.4, seed=3)
    assert held.holdout["train_val_per_class"] == {"a_cat": [3, 2], "b_dog": [3, 2]}
    val = {e.path for e in held.splits["val"]}
    assert val.isdisjoint(e.path for e in held.splits["train"]) and len(val) == 4
    assert val == {e.path for e in list_imagefolder(str(root), val_fraction=0.4, seed=3).splits["val"]}
    assert val != {e.path for e in list_imagefolder(str(root), val_fraction=0.4, seed=4).splits["val"]}


def test_validation_folder_is_the_val_split_and_test_is_never_listed(tmp_path):
    root = _tree(tmp_path / "ds", {"train": {"x": ["1.jpg", "2.jpg"], "y": ["3.jpg"]},
                                   "validation": {"y": ["v.jpg"]}, "test": {"x": ["t.jpg"], "z": ["u.jpg"]}})
    assert run_val_fraction(str(root), 0.0) == 0.0  # the source's own val split is used, not a hold-out
    listing = list_imagefolder(str(root))
    assert listing.classes == ["x", "y"]
    assert [(e.path, e.label) for e in listing.splits["val"]] == [("validation/y/v.jpg", 1)]
    assert not any(e.path.startswith("test/") for split in listing.splits.values() for e in split)
    with pytest.raises(DataError, match=str(root / "validation")) as err:
        list_imagefolder(str(root), val_fraction=0.2)
    assert "has a validation/ split" in str(err.value)


def test_val_and_validation_together_are_refused_naming_both(tmp_path):
    root = _tree(tmp_path / "ds", {"train": {"x": ["1.jpg"]}, "val": {"x": ["2.jpg"]}, "validation": {"x": ["3.jpg"]}})
    with pytest.raises(DataError, match="both val/ and validation/"):
        list_imagefolder(str(root))


def test_split_without_images_error_names_the_split(tmp_path):
    root = _tree(tmp_path / "ds", {"train": {"x": ["1.jpg"]}})
    (root / "val" / "x").mkdir(parents=True)
    (root / "val" / "x" / "a.txt").write_text("no image")
    with pytest.raises(DataError, match=f"{root / 'val'}: no images"):
        list_imagefolder(str(root))


def test_empty_class_folder_error_names_the_folder(tmp_path):
    root = _tree(tmp_path / "ds", {"train": {"x": ["1.jpg"]}})
    (root / "train" / "empty_cls").mkdir()
    with pytest.raises(DataError, match=f"{root / 'train' / 'empty_cls'}: class folder has no images"):
        list_imagefolder(str(root))


def test_unknown_val_class_error_names_it(tmp_path):
    root = _tree(tmp_path / "ds", {"train": {"x": ["1.jpg"]}, "val": {"x": ["2.jpg"], "stranger": ["3.jpg"]}})
    with pytest.raises(DataError, match="'stranger' is not among the 1 train classes"):
        list_imagefolder(str(root))


def test_root_that_is_a_file_is_rejected(tmp_path):
    f = tmp_path / "file.jpg"
    _img(f)
    with pytest.raises(DataError, match=f"{f}: is a file"):
        list_imagefolder(str(f))


def test_class_folders_listed_in_parallel_give_the_order_of_a_one_by_one_listing(tmp_path, monkeypatch):
    from lightray.data import source

    spec = {"train": {f"c{i:02d}": [f"{j}.jpg" for j in range(i % 4 + 1)] for i in range(40)},
            "val": {"c03": ["v1.jpg", "v0.jpg"], "c17": ["v2.jpg"]}}
    root = _tree(tmp_path / "ds", spec)
    _img(root / "train" / "c05" / "nested" / "deep.jpg")  # subfolders of a class are its images too
    _img(root / "train" / ".cache" / "x.jpg")  # a hidden folder is not a class
    _img(root / "train" / "loose.jpg")  # nor is a file beside the class folders
    many = list_imagefolder(str(root))
    monkeypatch.setattr(source, "LIST_THREADS", 1)
    one = list_imagefolder(str(root))
    assert many.splits == one.splits and many.fingerprint() == one.fingerprint()
    assert many.classes == [f"c{i:02d}" for i in range(40)]
    paths = [e.path for e in many.splits["train"]]
    assert paths == sorted(paths) and "train/c05/nested/deep.jpg" in paths and len(paths) == 101
    assert [e.path for e in many.splits["val"]] == ["val/c03/v0.jpg", "val/c03/v1.jpg", "val/c17/v2.jpg"]
