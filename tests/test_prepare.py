"""prepare() on real JPEG trees with a real local Ray cluster: contract, no-op rerun, resume, checksums, bad files."""

from __future__ import annotations

import io
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from lightray.config import Config, Phase
from lightray.data.manifest import Manifest, find_manifest
from lightray.data.prepare import PROGRESS_DIR, prepare, prepare_main, tiers_for
from lightray.data.source import DataError, list_imagefolder

REPO = pathlib.Path(__file__).resolve().parents[1]
CLASSES = ("ant", "bee", "cow")
TIERS = [32, 48, 72]  # 32 and 48 stored raw (raw_max_resolution=48), 72 as JPEG


def make_tree(root: pathlib.Path, train_per_class: int = 6, val_per_class: int = 2, seed: int = 0) -> pathlib.Path:
    """Real JPEGs of varied sizes and aspect ratios; each image's colour encodes its class."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", train_per_class), ("val", val_per_class)):
        for label, cls in enumerate(CLASSES):
            d = root / split / cls
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                h, w = int(rng.integers(40, 140)), int(rng.integers(40, 140))
                arr = np.zeros((h, w, 3), np.uint8)
                arr[..., label] = 200
                arr += (rng.random((h, w, 3)) * 40).astype(np.uint8)
                Image.fromarray(arr).save(d / f"{i:03d}.jpg", quality=90)
    return root


def run_prepare(src: pathlib.Path, cache: pathlib.Path, **kw) -> pathlib.Path:
    kw.setdefault("raw_max_resolution", 48)
    kw.setdefault("shard_rows", 4)
    return pathlib.Path(prepare(str(src), str(cache), TIERS, **kw))


def read_shard(path: str):
    return pq.read_table(path).to_pydict()


def file_stamps(folder: pathlib.Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.glob("*.parquet")}


def all_ids(man: Manifest, split: str, tier: int) -> list[int]:
    return [sid for s in man.shards(split, tier) for sid in read_shard(s.uri)["sample_id"]]


def test_manifest_and_shards_follow_the_contract_with_same_order_at_every_tier(tmp_path, ray_cluster):
    src = make_tree(tmp_path / "src")
    out = run_prepare(src, tmp_path / "cache")
    man = Manifest.load(str(out))
    raw = json.loads((out / "manifest.json").read_text())
    assert raw["key"] == out.name and raw["classes"] == list(CLASSES) and raw["bad_files"] == "bad_files.json"
    assert man.classes == list(CLASSES)
    assert man.num_samples("train") == 18 and man.num_samples("val") == 6
    assert man.tiers("train") == TIERS and man.tiers("val") == TIERS
    assert [man.format("train", t) for t in TIERS] == ["raw", "raw", "jpeg"]
    listing = list_imagefolder(str(src))
    for split in ("train", "val"):
        per_tier = {t: [read_shard(s.uri) for s in man.shards(split, t)] for t in TIERS}
        orders = {t: [(sid, p) for tab in tabs for sid, p in zip(tab["sample_id"], tab["path"])]
                  for t, tabs in per_tier.items()}
        assert orders[32] == orders[48] == orders[72]  # row i of shard j is the same sample at every tier
        # Every listed sample once, in a seeded mix (shards of a class-sorted listing must not be one class).
        assert sorted(sid for sid, _ in orders[32]) == list(range(len(listing.splits[split])))
        assert [sid for sid, _ in orders[32]] != list(range(len(listing.splits[split])))
        for t, tabs in per_tier.items():
            for tab in tabs:
                for i in range(len(tab["sample_id"])):
                    entry = listing.splits[split][tab["sample_id"][i]]
                    assert tab["path"][i] == entry.path and tab["label"][i] == entry.label
                    h, w = tab["height"][i], tab["width"][i]
                    assert min(h, w) == t  # short side = tier
                    oh, ow = tab["orig_height"][i], tab["orig_width"][i]
                    assert abs(w / h - ow / oh) < 0.05  # aspect kept
                    if man.format(split, t) == "raw":
                        img = np.frombuffer(tab["image"][i], np.uint8).reshape(h, w, 3)
                    else:
                        img = np.asarray(Image.open(io.BytesIO(tab["image"][i])).convert("RGB"))
                        assert img.shape == (h, w, 3)
                    assert int(np.argmax(img.reshape(-1, 3).mean(0))) == entry.label  # the right picture
    schema = pq.read_schema(man.shards("train", 72)[0].uri)
    assert [(f.name, str(f.type)) for f in schema] == [
        ("sample_id", "int64"), ("label", "int32"), ("image", "binary"), ("height", "int32"), ("width", "int32"),
        ("orig_height", "int32"), ("orig_width", "int32"), ("path", "string")]
    assert all(man.verify_shard("train", t, i) for t in TIERS for i in range(len(man.shards("train", t))))
    assert find_manifest(str(tmp_path / "cache"), out.name).key == out.name


def test_rerun_with_same_inputs_rewrites_nothing_and_says_so(tmp_path, ray_cluster, caplog):
    src = make_tree(tmp_path / "src", train_per_class=3, val_per_class=1)
    out = run_prepare(src, tmp_path / "cache")
    before = file_stamps(out)
    manifest_stamp = (out / "manifest.json").stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="lightray.prepare"):
        again = run_prepare(src, tmp_path / "cache")
    assert again == out
    assert file_stamps(out) == before and (out / "manifest.json").stat().st_mtime_ns == manifest_stamp
    assert any("nothing to do" in r.getMessage() for r in caplog.records)
    # A different preprocessing parameter is a different cache, never a reuse of this one.
    other = run_prepare(src, tmp_path / "cache", jpeg_quality=70)
    assert other != out and file_stamps(out) == before


def test_prepare_calls_ray_data_without_its_deprecated_arguments(tmp_path, ray_cluster):
    # Ray Data logs a deprecation warning for map(concurrency=) on every prepare: noise a user cannot act on.
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("ray.data")
    logger.addHandler(handler)
    try:
        run_prepare(make_tree(tmp_path / "src", train_per_class=2, val_per_class=1), tmp_path / "cache")
    finally:
        logger.removeHandler(handler)
    assert seen and not [m for m in seen if "deprecated" in m.lower()], seen


def test_interrupted_prepare_keeps_finished_shards_and_completes_the_rest(tmp_path, ray_cluster, caplog):
    src = make_tree(tmp_path / "src", train_per_class=8, val_per_class=2)
    cache = tmp_path / "cache"
    # The child prepares with one task at a time and kills itself (SIGKILL, no cleanup) after 2 shards.
    script = textwrap.dedent(f"""
        import os, signal, ray
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        from lightray.data.prepare import prepare
        def die(done, total):
            if done >= 2:
                os.kill(os.getpid(), signal.SIGKILL)
        prepare({str(src)!r}, {str(cache)!r}, {TIERS!r}, raw_max_resolution=48, shard_rows=2, concurrency=1,
                progress=die)
        raise SystemExit("prepare finished without being interrupted")
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["PYTHONPATH"] = str(REPO)
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        log_text = child.communicate(timeout=240)[0].decode(errors="replace")
    finally:
        try:
            os.killpg(child.pid, signal.SIGKILL)  # the child's own session: stray Ray processes it started
        except ProcessLookupError:
            pass
    assert child.returncode == -signal.SIGKILL, log_text[-3000:]
    (key_dir,) = [p for p in cache.iterdir() if p.is_dir()]
    assert not (key_dir / "manifest.json").exists()
    sidecars = sorted((key_dir / PROGRESS_DIR).glob("*.json"))
    total_units = 12 + 3  # 24 train / 2, 6 val / 2
    assert 2 <= len(sidecars) < total_units
    kept = {}
    for sc in sidecars:
        for f in json.loads(sc.read_text())["files"].values():
            st = (key_dir / f["file"]).stat()
            kept[f["file"]] = (st.st_ino, st.st_mtime_ns)

    with caplog.at_level(logging.INFO, logger="lightray.prepare"):
        out = pathlib.Path(prepare(str(src), str(cache), TIERS, raw_max_resolution=48, shard_rows=2))
    assert out == key_dir
    assert any("resuming" in r.getMessage() for r in caplog.records)
    now = file_stamps(key_dir)
    assert {k: now[k] for k in kept} == kept  # finished shards were kept, not rebuilt
    man = Manifest.load(str(out))
    for split, n in (("train", 24), ("val", 6)):
        assert man.num_samples(split) == n
        for t in TIERS:
            ids = all_ids(man, split, t)
            assert sorted(ids) == list(range(n)) and len(set(ids)) == n  # none missing, none twice
        assert all_ids(man, split, 32) == all_ids(man, split, 72)
    assert not [p for p in key_dir.iterdir() if ".tmp-" in p.name]


def test_corrupted_shard_fails_its_checksum_and_is_rebuilt(tmp_path, ray_cluster):
    src = make_tree(tmp_path / "src", train_per_class=4, val_per_class=1)
    out = run_prepare(src, tmp_path / "cache")
    man = Manifest.load(str(out))
    victim = man.shards("train", 72)[1]
    original = pathlib.Path(victim.uri).read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0xFF  # same size: only the checksum can tell
    pathlib.Path(victim.uri).write_bytes(bytes(flipped))
    assert not man.verify_shard("train", 72, 1)
    untouched = {k: v for k, v in file_stamps(out).items() if "-00001." not in k}

    run_prepare(src, tmp_path / "cache", verify=True)
    man2 = Manifest.load(str(out))
    assert man2.verify_shard("train", 72, 1)
    assert pathlib.Path(victim.uri).read_bytes() == original  # rebuilt bit for bit
    assert man2.shards("train", 72)[1].sha256 == victim.sha256
    now = file_stamps(out)
    assert {k: now[k] for k in untouched} == untouched  # only the damaged shard's unit was redone

    # A truncated shard (size differs) is caught even without a full re-hash.
    other = man2.shards("val", 32)[0]
    pathlib.Path(other.uri).write_bytes(pathlib.Path(other.uri).read_bytes()[:100])
    run_prepare(src, tmp_path / "cache")
    assert Manifest.load(str(out)).verify_shard("val", 32, 0)


def test_bad_files_are_listed_with_reasons_and_shift_no_label(tmp_path, ray_cluster):
    src = make_tree(tmp_path / "src", train_per_class=4, val_per_class=1)
    good = (src / "train/ant/000.jpg").read_bytes()
    bad = {
        "train/ant/001.jpg": good[: len(good) // 2],  # truncated
        "train/bee/000.jpg": good[:30] + bytes(range(256)) * 8,  # corrupt after the header
        "train/bee/zero.jpg": b"",  # zero bytes
        "train/cow/notes.jpg": b"shopping list: milk, eggs\n",  # text renamed .jpg
    }
    for rel, data in bad.items():
        (src / rel).write_bytes(data)
    listing = list_imagefolder(str(src))
    index = {e.path: i for i, e in enumerate(listing.splits["train"])}

    out = run_prepare(src, tmp_path / "cache")
    man = Manifest.load(str(out))
    listed = {b["path"]: b for b in man.bad_files()}
    assert set(listed) == set(bad)
    assert "truncated" in listed["train/ant/001.jpg"]["reason"]
    assert "zero-byte" in listed["train/bee/zero.jpg"]["reason"]
    assert "not an image" in listed["train/cow/notes.jpg"]["reason"]
    assert listed["train/bee/000.jpg"]["reason"]
    assert all(listed[p]["sample_id"] == index[p] for p in bad)
    assert man.num_samples("train") == len(listing.splits["train"]) - len(bad)
    for t in TIERS:
        rows = [(sid, lab, p) for s in man.shards("train", t) for sid, lab, p in
                zip(*(read_shard(s.uri)[c] for c in ("sample_id", "label", "path")))]
        assert sorted(sid for sid, _, _ in rows) == sorted(set(range(len(listing.splits["train"]))) - set(
            index[p] for p in bad))
        assert all(sid == index[p] and lab == CLASSES.index(p.split("/")[1]) for sid, lab, p in rows)


def test_limit_takes_evenly_spaced_samples_from_every_class(tmp_path, ray_cluster):
    src = make_tree(tmp_path / "src", train_per_class=4, val_per_class=2)
    man = Manifest.load(str(run_prepare(src, tmp_path / "cache", limit={"train": 6, "val": 0})))
    assert man.num_samples("train") == 6 and man.num_samples("val") == 6
    tab = [read_shard(s.uri) for s in man.shards("train", 32)]
    assert sorted({lab for t in tab for lab in t["label"]}) == [0, 1, 2]
    assert sorted(sid for t in tab for sid in t["sample_id"]) == [0, 2, 4, 6, 8, 10]


def test_bad_parameters_and_sources_fail_before_any_work(tmp_path):
    src = make_tree(tmp_path / "src", train_per_class=1, val_per_class=1)
    with pytest.raises(DataError, match=r"tiers: bad value \[\]"):
        prepare(str(src), str(tmp_path / "cache"), [])
    with pytest.raises(DataError, match="tiers: bad value 3"):
        prepare(str(src), str(tmp_path / "cache"), [3])
    with pytest.raises(DataError, match="limit: bad key 'test'"):
        prepare(str(src), str(tmp_path / "cache"), [32], limit={"test": 1})
    with pytest.raises(DataError, match=str(tmp_path / "missing")):
        prepare(str(tmp_path / "missing"), str(tmp_path / "cache"), [32])
    assert not (tmp_path / "cache").exists()


def test_prepare_main_builds_the_demo_at_the_schedule_resolutions(tmp_path, ray_cluster):
    cfg = Config()
    cfg.data.cache_dir = str(tmp_path / "cache")
    cfg.data.demo_classes, cfg.data.demo_train_per_class, cfg.data.demo_val_per_class = 2, 3, 1
    cfg.schedule.epochs = 2
    cfg.schedule.phases = [Phase(until_epoch=1, resolution=32, batch_size=2),
                           Phase(until_epoch=2, resolution=48, batch_size=2)]
    cfg.schedule.eval_resolution = 56
    cfg.data.raw_max_resolution = 48
    assert tiers_for(cfg) == [32, 48, 56]
    # Make the demo tree in a separate process first: forking from a process running Ray is unsafe, and
    # ensure_demo uses a process pool; prepare_main then finds the finished tree.
    gen = ("import sys; from lightray.config import Config; from lightray.data.demo import ensure_demo; c = Config(); "
           "c.data.demo_classes, c.data.demo_train_per_class, c.data.demo_val_per_class = 2, 3, 1; "
           "ensure_demo(sys.argv[1], c.data)")
    subprocess.run([sys.executable, "-c", gen, cfg.data.cache_dir], cwd=REPO, check=True,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    man = Manifest.load(str(prepare_main(cfg)))
    assert man.tiers("train") == [32, 48, 56] and man.format("train", 48) == "raw" and man.format("train", 56) == "jpeg"
    assert man.classes == ["circle", "ring"]
    assert man.num_samples("train") == 6 and man.num_samples("val") == 2
