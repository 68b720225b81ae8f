"""The columnar listing keeps the per-file listing's identity: the same cache key, order and hold-out as the
per-entry formulas it replaced (written out here, over a walk of the tree that does not use the listing)."""

from __future__ import annotations

import hashlib
import os
import pathlib

from PIL import Image

from lightray.data.source import SPLIT_SCHEMA, SourceEntry, SplitTable, list_imagefolder


def _tree(root: pathlib.Path, spec: dict[str, dict[str, int]]) -> pathlib.Path:
    for split, classes in spec.items():
        for c, (name, n) in enumerate(sorted(classes.items())):
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.new("RGB", (8, 8), (30 * c % 256, i, 7)).save(root / split / name / f"é{i:02d}.jpg", "JPEG")
    return root


def _walk(root: pathlib.Path, split: str, classes: list[str]) -> list[SourceEntry]:
    """The split's entries from os.walk/os.stat, sorted by path as Python sorts str."""
    out = []
    for d, _, files in os.walk(root / split):
        for f in files:
            rel = (pathlib.Path(d) / f).relative_to(root).as_posix()
            st = os.stat(pathlib.Path(d) / f)
            out.append(SourceEntry(rel, st.st_size, st.st_mtime_ns, classes.index(rel.split("/")[1])))
    return sorted(out, key=lambda e: e.path)


def _old_fingerprint(root: str, classes: list[str], splits: dict[str, list[SourceEntry]],
                     holdout: dict | None = None) -> str:
    h = hashlib.sha256()
    h.update(f"root\0{root}\nclasses\0{chr(0).join(classes)}\n".encode())
    if holdout is not None:
        h.update(f"holdout\0{holdout['val_fraction']!r}\0{holdout['seed']}\n".encode())
    for split in sorted(splits):
        for e in splits[split]:
            h.update(f"{split}\0{e.path}\0{e.size}\0{e.mtime_ns}\0{e.label}\n".encode())
    return h.hexdigest()


def test_fingerprint_and_order_are_those_of_the_per_entry_listing(tmp_path):
    classes = ["a", "a-b", "a_b", "z"]  # '-' < '/' < '_': a class's files are not in class order by path
    root = _tree(tmp_path / "ds", {"train": {c: 3 + i for i, c in enumerate(classes)}, "val": {"a_b": 2, "z": 1}})
    listing = list_imagefolder(str(root))
    want = {s: _walk(root, s, classes) for s in ("train", "val")}
    assert listing.classes == classes
    assert {s: list(listing.splits[s]) for s in want} == want
    assert listing.fingerprint() == _old_fingerprint(str(root), classes, want)
    assert all(isinstance(t, SplitTable) and t.table.schema == SPLIT_SCHEMA for t in listing.splits.values())


def test_holdout_picks_what_the_per_entry_hold_out_picked(tmp_path):
    counts = {"a": 10, "a-b": 7, "b": 13}
    root = _tree(tmp_path / "ds", {"train": counts})
    fraction, seed = 0.25, 5
    listing = list_imagefolder(str(root), fraction, seed)
    entries = _walk(root, "train", sorted(counts))
    train, val = [], []
    for label in range(len(counts)):  # the per-entry formula: rank each class by sha256(seed, path)
        mine = [e for e in entries if e.label == label]
        k = int(len(mine) * fraction + 0.5)
        ranked = sorted(mine, key=lambda e: hashlib.sha256(f"{seed}\0{e.path}".encode()).digest())
        val += ranked[:k]
        train += ranked[k:]
    train.sort(key=lambda e: e.path)
    val.sort(key=lambda e: e.path)
    assert list(listing.splits["train"]) == train and list(listing.splits["val"]) == val
    assert listing.holdout["val_paths_sha256"] == hashlib.sha256("".join(f"{e.path}\n" for e in val).encode()
                                                                  ).hexdigest()
    assert listing.holdout["train_val_per_class"] == {"a": [7, 3], "a-b": [5, 2], "b": [10, 3]}
    assert listing.fingerprint() == _old_fingerprint(str(root), sorted(counts), {"train": train, "val": val},
                                                     listing.holdout)


def test_split_table_indexes_slices_and_compares_like_the_list_it_replaced():
    rows = [SourceEntry(f"train/c/{i}.jpg", 100 + i, 10**18 + i, i % 3) for i in range(5)]
    table = SplitTable.from_entries(rows)
    assert len(table) == 5 and list(table) == rows and table[2] == rows[2] and table[-1] == rows[-1]
    assert table.rows([4, 0]) == [rows[4], rows[0]] and list(table.take([1, 3])) == [rows[1], rows[3]]
    assert table.column("size").tolist() == [100, 101, 102, 103, 104]
    assert table == SplitTable.from_entries(rows) and table != SplitTable.from_entries(rows[:4])


def test_shard_plan_carries_row_ranges_and_each_shard_reads_back_its_listing_rows(tmp_path):
    from lightray.data.prepare import _plan_cache, _plan_shards, unit_rows

    root = _tree(tmp_path / "ds", {"train": {"a": 9, "b": 8}, "val": {"a": 3}})
    listing = list_imagefolder(str(root))
    cache = _plan_cache(listing, str(tmp_path / "cache"), [16], 90, 16, 4, {"train": 10})
    units = _plan_shards(cache, {"train": 10}, 4, 90, 2)
    assert [(u["split"], u["index"], u["rows"]) for u in units] == [
        ("train", 0, [0, 4]), ("train", 1, [4, 8]), ("train", 2, [8, 10]), ("val", 0, [0, 3])]
    assert not any(isinstance(v, list) and len(v) > 2 for u in units for v in u.values())  # no per-file lists
    for split, want in (("train", 10), ("val", 3)):
        rows = [r for u in units if u["split"] == split for r in unit_rows(cache, u)]
        assert len(rows) == want and len({sid for sid, *_ in rows}) == want
        for sid, path, size, label in rows:
            e = listing.splits[split][sid]
            assert (path, size, label) == (e.path, e.size, e.label)
