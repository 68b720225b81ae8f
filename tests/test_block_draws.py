"""A block's crop draws and the CPU path's whole-photo crops, made cheaply without changing a pixel: the block's
uniforms are numpy's own ``default_rng([seed, epoch, id, stream]).random(k)`` streams bit for bit (computed for the
whole block at once), a numpy whose streams drifted falls back to its own generators and says so, and a crop that
is the whole photo at its stored size is the stored pixels (mirrored where drawn), as PIL's crop gives them, from
real prepared shards stored raw and as JPEG; from raw and decoded (object-store) shards of equal photos a block of
them is gathered a shard at a time, with the same pixels as the per-sample copy."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
from PIL import Image

from lightray.data import augment, pcg_streams, shard_cache, task_batches
from lightray.data.ingest import IngestSpec, PhaseSpec, phase_blocks, tier_shards, train_block_batch
from lightray.data.manifest import Manifest
from lightray.data.prepare import prepare
from tests.conftest import start_session_ray

SEED = 3


def numpys_own(rows: list[list[int]], k: int) -> np.ndarray:
    return np.stack([np.random.default_rng(row).random(k) for row in rows])


@pytest.mark.parametrize("seed", [0, 1, 2**31 - 1, 2**32 + 7, 2**64 - 1])
def test_block_uniforms_are_numpys_generator_streams_bit_for_bit(seed):
    rng = np.random.default_rng(seed % 1000)
    n = 400
    # sample ids below and above 2**32 (two entropy words), epochs from 0, in one block
    ids = np.concatenate([rng.integers(0, 2**32, n // 2), rng.integers(2**32, 2**63, n // 4), np.arange(n // 4)])
    epochs = rng.integers(0, 300, n)
    for k in (1, 23):
        got = pcg_streams.uniforms([seed, epochs, ids, 0xA06], k)
        want = numpys_own([[seed, int(e), int(i), 0xA06] for e, i in zip(epochs, ids)], k)
        assert got.dtype == np.float64 and got.shape == (n, k)
        assert np.array_equal(got, want)
    # and the crop draws made from them: a block's boxes and flips are those of each sample's own generator
    u = augment.sample_uniforms(seed, epochs, ids, 23)
    assert np.array_equal(u, numpys_own([[seed, int(e), int(i), 0xA06] for e, i in zip(epochs, ids)], 23))


def test_more_entropy_words_than_the_pool_holds_are_mixed_in_as_numpy_mixes_them():
    # five columns, two of them wide: seven uint32 words against SeedSequence's pool of four
    cols = [2**40 + 1, np.arange(50), np.arange(50) * 2**33, 9, 2**35]
    got = pcg_streams.uniforms(cols, 5)
    assert np.array_equal(got, numpys_own([[2**40 + 1, i, i * 2**33, 9, 2**35] for i in range(50)], 5))


def test_a_negative_entry_is_refused_as_numpy_refuses_it():
    with pytest.raises(ValueError):
        pcg_streams.uniforms([SEED, np.array([0, -1]), np.array([4, 5]), 0xA06], 3)
    assert pcg_streams.uniforms([SEED, np.zeros(0, np.int64), np.zeros(0, np.int64), 1], 3).shape == (0, 3)


def test_a_numpy_whose_streams_drifted_gets_its_own_generators_and_a_warning(monkeypatch, caplog):
    # A drift is simulated on our side (a wrong multiplier): the self-check must catch it and keep the draws right.
    monkeypatch.setattr(pcg_streams, "_MUL_LO", np.uint64(4865540595714422343))
    monkeypatch.setattr(pcg_streams, "_checked", None)
    ids = np.arange(30)
    with caplog.at_level(logging.WARNING, logger="lightray.data.pcg_streams"):
        got = pcg_streams.uniforms([SEED, np.zeros(30, np.int64), ids, 0xA06], 4)
    assert np.array_equal(got, numpys_own([[SEED, 0, i, 0xA06] for i in range(30)], 4))
    assert any("no longer matches" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(pcg_streams, "_checked", None)  # the next test's process checks again


def photo(seed: int, size: int = 32) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size].astype(np.float64)
    img = np.stack([100 + 60 * np.sin(rng.uniform(1, 5) * x / size * 6.28 + c) + 40 * y / size for c in range(3)], -1)
    img[rng.integers(0, size):, : rng.integers(1, size)] = rng.uniform(0, 255, 3)  # an edge, so mirroring shows
    return np.clip(img, 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def square_photos(tmp_path_factory) -> dict[str, Manifest]:
    """24 square 32 px photos in 2 classes, prepared twice: stored raw and stored as JPEG."""
    root = tmp_path_factory.mktemp("square")
    for label in ("cat", "dog"):
        (root / "src" / "train" / label).mkdir(parents=True)
        (root / "src" / "val" / label).mkdir(parents=True)
        for i in range(12):
            Image.fromarray(photo(100 * (label == "dog") + i)).save(root / "src" / "train" / label / f"{i}.png")
        Image.fromarray(photo(999)).save(root / "src" / "val" / label / "0.png")
    start_session_ray()
    return {fmt: Manifest.load(str(prepare(str(root / "src"), str(root / f"cache_{fmt}"), [32],
                                           raw_max_resolution=32 if fmt == "raw" else 0, shard_rows=8)))
            for fmt in ("raw", "jpeg")}


@pytest.mark.parametrize("fmt", ["raw", "jpeg"])
def test_a_whole_photo_crop_is_the_stored_pixels_mirrored_as_pil_crops_them(square_photos, fmt, tmp_path):
    m = square_photos[fmt]
    spec = IngestSpec(seed=SEED, local_dir=str(tmp_path / "local"), train_size=m.num_samples("train"),
                      phases=[PhaseSpec(0, 32, 8, 1.0, 0, 3, tier_shards(m, "train", 32))],
                      val=tier_shards(m, "val", 32), eval_resolution=32, val_crop_ratio=1.0)
    ph = spec.phases[0]
    assert ph.shards.fmt == fmt
    blocks = {k: np.array([b[k] for b in phase_blocks(spec, 0, 0, 0)]) for k in ("epoch", "step0", "nsteps")}
    got = train_block_batch(blocks, spec=spec, phase=0, rank=0, world_size=1)
    assert len(got["image"]) == 3 * 24
    stored = {}
    for px, _label, sid in ph.shards.arrays(spec.local_dir, np.repeat(np.arange(len(ph.shards.rows)), ph.shards.rows),
                                            np.concatenate([np.arange(r) for r in ph.shards.rows])):
        stored[sid] = np.array(px)
    n = len(got["sample_id"])
    boxes, flips = augment.draw_crops(SEED, got["epoch"], got["sample_id"], np.full(n, 32), np.full(n, 32), 1.0)
    assert augment.copies_whole(boxes, np.full(n, 32), np.full(n, 32), 32).all()  # so the copy path ran
    assert 0 < flips.sum() < n
    for i, sid in enumerate(got["sample_id"].tolist()):
        # what the CPU path gave before the copy: PIL's crop of the whole photo to 32 px, then the mirror
        want = augment.train_crop(Image.fromarray(stored[sid]), 32, boxes[i], bool(flips[i]))
        assert np.array_equal(got["image"][i], want), (sid, bool(flips[i]))
        assert not np.array_equal(want, want[:, ::-1])  # the mirror is visible in these photos

    # a crop smaller than the photo still goes through PIL: scale below 1 gives boxes inside the photo
    spec.phases[0] = PhaseSpec(0, 32, 8, 0.5, 0, 3, tier_shards(m, "train", 32))
    smaller = train_block_batch(blocks, spec=spec, phase=0, rank=0, world_size=1)
    b2, f2 = augment.draw_crops(SEED, smaller["epoch"], smaller["sample_id"], np.full(n, 32), np.full(n, 32), 0.5)
    assert not augment.copies_whole(b2, np.full(n, 32), np.full(n, 32), 32).any()
    for i, sid in enumerate(smaller["sample_id"].tolist()[:12]):
        assert np.array_equal(smaller["image"][i],
                              augment.train_crop(Image.fromarray(stored[sid]), 32, b2[i], bool(f2[i])))


@pytest.mark.parametrize("level", ["raw", "object_store"])
def test_a_block_of_whole_photos_is_one_gather_per_shard_with_the_per_sample_copys_pixels(square_photos, level,
                                                                                          tmp_path):
    import ray

    m = square_photos["raw" if level == "raw" else "jpeg"]
    shards = tier_shards(m, "train", 32)
    if level == "object_store":  # what a run's tier decoded once holds: DecodedShard refs
        shards = dataclasses.replace(shards, refs=[
            ray.put(shard_cache.decode_shard(u, h, shards.fmt, str(tmp_path / "decode")))
            for u, h in zip(shards.uris, shards.sha256)])
    ph = PhaseSpec(0, 32, 8, 1.0, 0, 3, shards)
    spec = IngestSpec(seed=SEED, local_dir=str(tmp_path / "local"), train_size=m.num_samples("train"), phases=[ph],
                      val=tier_shards(m, "val", 32), eval_resolution=32, val_crop_ratio=1.0)
    every = np.repeat(np.arange(len(shards.rows)), shards.rows), np.concatenate([np.arange(r) for r in shards.rows])
    pick = np.random.default_rng(0).permutation(np.tile(np.arange(len(every[0])), 2))  # shards interleaved, twice
    shard_idx, rows = every[0][pick], every[1][pick]
    flips = np.random.default_rng(1).random(len(pick)) < 0.5
    assert shards.square_pixels(spec.local_dir, shard_idx, rows, 32) is not None  # so the gather path runs
    got = task_batches.whole_photos(spec, ph, shard_idx, rows, flips)
    stored = [np.array(px) for px, _label, _sid in shards.arrays(spec.local_dir, shard_idx, rows)]
    assert np.array_equal(got, np.stack([px[:, ::-1] if f else px for px, f in zip(stored, flips)]))
    assert 0 < flips.sum() < len(flips) and got.flags.writeable  # a batch of its own, not a view of the shard
    # a JPEG shard's rows are not pixels: no gather, and the per-sample copy gives the same batch
    jpeg = dataclasses.replace(ph, shards=tier_shards(square_photos["jpeg"], "train", 32))
    assert jpeg.shards.square_pixels(spec.local_dir, shard_idx, rows, 32) is None
    assert task_batches.whole_photos(spec, jpeg, shard_idx, rows, flips).shape == got.shape


def test_rows_of_another_size_or_not_back_to_back_are_not_viewed_as_one_block():
    rows = [np.full((2, 2, 3), i, np.uint8) for i in range(3)]
    flat = np.concatenate([r.reshape(-1) for r in rows])
    offsets = np.arange(4, dtype=np.int64) * 12
    two = np.full(3, 2)
    assert np.array_equal(shard_cache.square_view(flat, offsets, two, two, 2), np.stack(rows))
    assert shard_cache.square_view(flat, offsets, two, two, 3) is None  # not the size asked for
    assert shard_cache.square_view(flat, offsets, np.array([2, 2, 1]), two, 2) is None  # one row of another size
    gap = np.concatenate([flat[:12], np.zeros(4, np.uint8), flat[12:]])
    assert shard_cache.square_view(gap, np.array([0, 16, 28, 40]), two, two, 2) is None  # rows not back to back
    assert shard_cache.square_view(flat, offsets[:1], two[:0], two[:0], 2) is None  # an empty shard
