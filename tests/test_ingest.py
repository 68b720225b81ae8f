"""The read side of the shard cache and validation, on real JPEGs, real Parquet shards and a real Ray cluster:
which level serves each phase, the object store serving the shard tier's pixels, node-local copies,
centre-crop and rectangular validation against a plain per-image evaluation, the preprocessing autotune."""

from __future__ import annotations

import io
import json
import pathlib

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn as nn
from PIL import Image

from bench.pipeline import make_source
from lightray.config import load_config
from lightray.data import augment, autotune, shard_cache
from lightray.data.ingest import (
    IngestSpec,
    PhaseSpec,
    PlanDataConfig,
    materialize_tiers,
    phase_blocks,
    plan_rect_validation,
    tier_shards,
    train_block_batch,
    val_block_batch,
    val_dataset,
)
from lightray.data.manifest import Manifest
from lightray.data.prepare import prepare
from lightray.train.evaluate import evaluate
from tests.conftest import start_session_ray

TIERS = [16, 24]  # 16 stored raw, 24 as JPEG


@pytest.fixture(scope="module")
def cluster():
    start_session_ray()


@pytest.fixture(scope="module")
def manifest(cluster, tmp_path_factory) -> Manifest:
    root = tmp_path_factory.mktemp("ingest")
    src = make_source(root / "src", n_train=120, n_val=36, classes=3, size=(40, 30))
    return Manifest.load(str(prepare(str(src), str(root / "cache"), TIERS, raw_max_resolution=16, shard_rows=32)))


def make_spec(manifest: Manifest, local_dir: str, epochs: int = 2) -> IngestSpec:
    """Phase 0 at 16 px (raw tier), phase 1 at 24 px (JPEG tier), centre-crop validation at 16 px."""
    return IngestSpec(seed=3, local_dir=local_dir, train_size=manifest.num_samples("train"),
                      phases=[PhaseSpec(0, 16, 24, 0.35, 0, 1, tier_shards(manifest, "train", 16)),
                              PhaseSpec(1, 24, 24, 0.5, 1, epochs, tier_shards(manifest, "train", 24))],
                      val=tier_shards(manifest, "val", 24), eval_resolution=16, val_crop_ratio=0.875, block_rows=48)


def blocks_of(spec: IngestSpec, phase: int) -> dict:
    blocks = phase_blocks(spec, phase, spec.phases[phase].first_epoch, 0)
    return {k: np.array([b[k] for b in blocks]) for k in ("epoch", "step0", "nsteps")}


def fresh_process_caches() -> None:
    shard_cache._OPEN.clear()
    for k in shard_cache.STATS:
        shard_cache.STATS[k] = 0


def test_each_phase_reads_the_level_its_decoded_size_fits(manifest, tmp_path):
    spec = make_spec(manifest, str(tmp_path / "local"))
    small = shard_cache.decoded_bytes(spec.phases[0].shards.uris)
    val = shard_cache.decoded_bytes(spec.val.uris)
    big = shard_cache.decoded_bytes(spec.phases[1].shards.uris)
    assert max(small, val) < big
    materialize_tiers(spec, (small + val + 1) / 2**20)  # the 16 px train and the val tier fit, 24 px train not
    assert [p.shards.level for p in spec.phases] == ["object_store", "local_disk"]
    assert spec.val.level == "object_store"
    cache_events = {e["served"]: e for e in spec.events if e["unit"] == "data_cache"}
    assert cache_events["phase 0 (16px)"]["level"] == "object_store"
    assert cache_events["phase 1 (24px)"]["level"] == "local_disk"
    assert "memory_budget_mb" in cache_events["phase 1 (24px)"]["message"]

    # And the map function really reads from there.
    fresh_process_caches()
    out = train_block_batch(blocks_of(spec, 0), spec=spec, phase=0, rank=0, world_size=1)
    assert shard_cache.STATS["object_store_reads"] > 0 and shard_cache.STATS["parquet_reads"] == 0
    assert out["image"].shape[1:] == (16, 16, 3)
    fresh_process_caches()
    out = train_block_batch(blocks_of(spec, 1), spec=spec, phase=1, rank=0, world_size=1)
    assert shard_cache.STATS["object_store_reads"] == 0 and shard_cache.STATS["parquet_reads"] > 0
    assert out["image"].shape[1:] == (24, 24, 3)


def test_object_store_serves_the_same_pixels_as_the_shard_tier(manifest, tmp_path):
    disk = make_spec(manifest, str(tmp_path / "local"))
    mem = make_spec(manifest, str(tmp_path / "local"))
    materialize_tiers(mem, 1024)
    assert mem.phases[1].shards.level == "object_store" and mem.val.level == "object_store"
    for phase in (0, 1):  # raw and JPEG tiers
        fresh_process_caches()
        a = train_block_batch(blocks_of(disk, phase), spec=disk, phase=phase, rank=1, world_size=2)
        b = train_block_batch(blocks_of(mem, phase), spec=mem, phase=phase, rank=1, world_size=2)
        assert len(a["sample_id"]) > 0
        for k in ("image", "label", "sample_id", "epoch"):
            assert np.array_equal(a[k], b[k]), (phase, k)
    block = {"start": np.array([0]), "end": np.array([36]), "width": np.array([16]), "height": np.array([16])}
    a = val_block_batch(block, spec=disk, rank=0, world_size=1, resolution=16)
    b = val_block_batch(block, spec=mem, rank=0, world_size=1, resolution=16)
    assert np.array_equal(a["image"], b["image"]) and np.array_equal(a["sample_id"], b["sample_id"])


def test_node_local_copy_is_made_once_and_a_corrupt_shard_is_refused(manifest, tmp_path):
    shard = manifest.shards("train", 24)[0]
    fresh_process_caches()
    p1 = shard_cache.local_copy(shard.uri, shard.sha256, str(tmp_path / "nvme"))
    p2 = shard_cache.local_copy(shard.uri, shard.sha256, str(tmp_path / "nvme"))
    assert p1 == p2 and shard_cache.STATS["copied"] == 1 and shard_cache.STATS["local_hits"] == 1
    assert shard_cache.sha256_file(p1) == shard.sha256
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(pathlib.Path(shard.uri).read_bytes()[:-10] + b"0123456789")
    with pytest.raises(OSError, match="bad.parquet: checksum .* does not match"):
        shard_cache.local_copy(str(bad), shard.sha256, str(tmp_path / "other"))
    assert not list((tmp_path / "other").rglob("*.parquet"))  # nothing half-trusted left behind


class TinyNet(nn.Module):
    """Any input size (global pooling); 10 outputs so that top-5 is not trivially 100% on 3 classes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))


def per_image_counts(model: nn.Module, manifest: Manifest, tier: int, resize) -> tuple[int, int, int]:
    """(n, top-1 hits, top-5 hits) scoring one image at a time, read straight from the Parquet shards."""
    from lightray.train import device as dev

    n = top1 = top5 = 0
    for shard in manifest.shards("val", tier):
        table = pq.read_table(shard.uri).to_pylist()
        for row in table:
            img = (Image.open(io.BytesIO(row["image"])).convert("RGB") if manifest.format("val", tier) == "jpeg"
                   else Image.fromarray(np.frombuffer(row["image"], np.uint8).reshape(row["height"], row["width"], 3)))
            x = dev.images_to_device(torch.from_numpy(resize(row["sample_id"], img)[None].copy()),
                                     torch.device("cpu"), True)
            with torch.no_grad():
                top = model(x).topk(5, dim=1).indices[0].tolist()
            n += 1
            top1 += top[0] == row["label"]
            top5 += row["label"] in top
    return n, top1, top5


def pipeline_counts(model: nn.Module, spec: IngestSpec, world: int) -> tuple[int, int, int, set]:
    """evaluate() over each rank's real Ray Data stream; counts summed as the all-reduce would."""
    cfg = load_config("smoke")
    iters = PlanDataConfig(spec).configure({"val": val_dataset(spec)}, world, None, None)
    n = top1 = top5 = 0
    shapes = set()
    for r in range(world):
        res = evaluate(model, iters[r]["val"], torch.device("cpu"), "fp32", cfg, batch_size=5)
        n += res["val_samples"]
        top1 += round(res["val_top1"] * res["val_samples"])
        top5 += round(res["val_top5"] * res["val_samples"])
        for block in iters[r]["val"].iter_batches(batch_size=None, batch_format="numpy"):
            shapes |= {block["image"].shape[1:3]} if len(block["label"]) else set()
    return n, top1, top5, shapes


def test_centre_crop_validation_matches_a_plain_per_image_evaluation(manifest, tmp_path):
    spec = make_spec(manifest, str(tmp_path / "local"))
    model = TinyNet().eval()
    n, top1, top5, shapes = pipeline_counts(model, spec, world=2)
    want = per_image_counts(model, manifest, spec.val.tier, lambda sid, img: augment.center_crop(img, 16, 0.875))
    assert (n, top1, top5) == want
    assert n == 36 and shapes == {(16, 16)}
    assert top5 > top1  # the check has teeth: top-5 is neither top-1 nor everything
    assert top5 < n


def test_rect_validation_matches_a_plain_per_image_evaluation(manifest, tmp_path):
    spec = make_spec(manifest, str(tmp_path / "local"))
    plan_rect_validation(spec, batch_size=8)
    # Each sample's rectangle, from the published plan (sorted positions -> batch -> shape).
    target = {}
    offsets = np.concatenate([[0], np.cumsum(spec.val.rows)])
    ids = np.concatenate([pq.read_table(s.uri, columns=["sample_id"]).column(0).to_numpy()
                          for s in manifest.shards("val", spec.val.tier)])
    assert len(offsets) and len(ids) == offsets[-1]
    for b in spec.val_batches:
        for pos in range(b["start"], b["end"]):
            target[int(ids[spec.val_order[pos]])] = (b["width"], b["height"])
    model = TinyNet().eval()
    n, top1, top5, shapes = pipeline_counts(model, spec, world=2)
    want = per_image_counts(model, manifest, spec.val.tier,
                            lambda sid, img: augment.rect_crop(img, *target[sid]))
    assert (n, top1, top5) == want and n == 36
    # Landscape and portrait batches both exist (sorted by aspect), and no image was squashed to a square.
    assert any(h > w for h, w in shapes) and any(w > h for h, w in shapes)
    assert any(e["unit"] == "rect_val" for e in spec.events)


def test_rect_target_keeps_the_short_side_and_rounds_the_long_side_to_8():
    assert augment.rect_target(4 / 3, 64) == (88, 64)
    assert augment.rect_target(3 / 4, 64) == (64, 88)
    assert augment.rect_target(1.0, 60) == (60, 60)
    img = Image.fromarray(np.zeros((30, 40, 3), np.uint8))
    assert augment.rect_crop(img, 88, 64).shape == (64, 88, 3)


def test_autotune_picks_the_smallest_concurrency_near_the_best_rate(manifest, tmp_path):
    spec = make_spec(manifest, str(tmp_path / "local"))
    choice = autotune.calibrate(spec, 1, avail_cpus=2, seconds=2.0)
    cs = [p["concurrency"] for p in choice.curve]
    assert cs == [1, 2, 4]  # 1, 2, 4, ... up to twice the CPUs left to data
    assert all(p["images_per_s"] > 0 for p in choice.curve)
    best = max(p["images_per_s"] for p in choice.curve)
    first_good = next(p["concurrency"] for p in choice.curve if p["images_per_s"] >= 0.9 * best)
    assert choice.concurrency == first_good
    assert choice.cpus == min(1.0, 2 / first_good)
    assert 64 <= choice.block_rows <= 4096 and choice.block_rows & (choice.block_rows - 1) == 0


def test_rows_per_task_aim_at_seconds_of_work_within_the_output_cap():
    # Ray Data sees a task end about 0.2 s late: a task holds about TASK_SECONDS of work
    assert autotune.rows_per_task(autotune.TASK_SECONDS / 500) == 512
    assert autotune.rows_per_task(0.004) == 512 and autotune.rows_per_task(0.002) == 1024
    # device canvases of 176 x 176: 4,096 rows would be 380 MB out; capped under Ray Data's 128 MiB block size
    rows = autotune.rows_per_task(0.0001, 176 * 176 * 3)
    assert rows == 1024 and rows * 176 * 176 * 3 <= autotune.MAX_TASK_BYTES
    assert autotune.rows_per_task(10.0) == autotune.MIN_TASK_ROWS  # slow images: never below the floor
    assert autotune.rows_per_task(1e-7) == autotune.MAX_TASK_ROWS


def test_autotune_applies_pinned_values_and_logs_its_choice(manifest, tmp_path, cluster):
    spec = make_spec(manifest, str(tmp_path / "local"))
    choice = autotune.apply(spec, concurrency=3, cpus=0.5, block_rows=96, seconds=4.0, train_cpus=1.0)
    assert (spec.map_concurrency, spec.map_cpus, spec.block_rows) == (3, 0.5, 96)
    assert choice.curve == [] and "pinned" in spec.events[-1]["message"]
    # Small data: no calibration, defaults for what is not pinned, and the log says why.
    spec = make_spec(manifest, str(tmp_path / "local"))
    autotune.apply(spec, concurrency=2, seconds=4.0, train_cpus=1.0)
    assert spec.map_concurrency == 2 and spec.map_cpus == 0.25 and spec.block_rows == 512
    assert "too few" in spec.events[-1]["message"]


def test_each_worker_group_start_sizes_ray_datas_cpu_share_and_tasks_in_flight_from_the_cluster_it_has_then(
        manifest, tmp_path):
    """The driver's cap was fixed before any worker existed (0.5 CPU on a head alone, for the whole run). Each
    worker-group start (Ray Train copies the data config into a new dataset manager each time) sizes it again:
    the cluster's CPUs now less what that group's workers hold, said once per start; the calibrated tasks in
    flight, measured on the driver's share, are scaled to it (they used to stay as measured on the floor)."""
    import pickle

    import ray
    from ray.data import DataContext, ExecutionResources

    total = ray.cluster_resources()["CPU"]
    ctx = DataContext.get_current()
    before = ctx.execution_options.resource_limits
    ctx.execution_options.resource_limits = ExecutionResources(cpu=0.5)  # the driver's cap, set on a head alone
    from functools import partial

    from lightray.driver.runner import record_to_runlog
    from lightray.report.runlog import start_runlog

    runlog = start_runlog("share-test", str(tmp_path / "run"), tensorboard=False)  # the run's records, as a run has
    spec = make_spec(manifest, str(tmp_path))
    # Calibrated at the driver's start on the 0.5-CPU floor: 2 tasks in flight, i.e. 4 per CPU of Ray Data's.
    spec.map_concurrency, spec.map_concurrency_cpus = 2, 0.5
    config = PlanDataConfig(spec, cpus_per_worker=1.5, record=partial(record_to_runlog, "share-test"))
    try:
        for world in (1, 3):  # a start on one worker, a restart on three
            start = pickle.loads(pickle.dumps(config))
            for _ in range(2):  # two datasets of one start: one share, said once
                start.configure({"val": val_dataset(spec)}, world, None, [f"node{r}" for r in range(world)])
                assert ctx.execution_options.resource_limits.cpu == max(0.5, total - 1.5 * world)
        said = [json.loads(line) for line in open(ray.get(runlog.flush.remote()))]
    finally:
        ctx.execution_options.resource_limits = before
        ray.kill(runlog)
    assert [(s["world_size"], s["nodes"], s["train_cpus"], s["data_cpus"]) for s in said] == [
        (1, 1, 1.5, total - 1.5), (3, 3, 4.5, max(0.5, total - 4.5))], said
    assert [s["tasks_in_flight"] for s in said] == [round(4 * s["data_cpus"]) for s in said]
    assert all(s["event"] == "unit" and s["unit"] == "data_share" and s["cluster_cpus"] == total for s in said)
    assert said[0]["message"].startswith(f"Ray Data gets {total - 1.5:g} of the cluster's {total:g} CPUs")
