"""The deterministic epoch plan through the real ingest: plan blocks -> PlanDataConfig -> Ray Data map tasks ->
each rank's ``iter_batches``, on real JPEG shards and a real local Ray cluster."""

from __future__ import annotations

import numpy as np
import pytest

from bench.pipeline import make_source
from lightray.data.ingest import IngestSpec, PhaseSpec, PlanDataConfig, make_blocks_dataset, phase_blocks, tier_shards
from lightray.data.manifest import Manifest
from lightray.data.plan import EpochPlan, rank_slice
from lightray.data.prepare import prepare
from tests.conftest import start_session_ray

BATCH = 21  # uneven across 2 and 3 workers on purpose; 100 samples -> 4 steps, a tail of 16 left out
EPOCHS = 2


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> IngestSpec:
    start_session_ray()
    root = tmp_path_factory.mktemp("plan")
    src = make_source(root / "src", n_train=100, classes=3, size=(24, 18))
    man = Manifest.load(str(prepare(str(src), str(root / "cache"), [16], raw_max_resolution=0, shard_rows=16)))
    train = tier_shards(man, "train", 16)
    yield IngestSpec(seed=7, local_dir=str(root / "local"), train_size=man.num_samples("train"),
                     phases=[PhaseSpec(0, 16, BATCH, 0.35, 0, EPOCHS, train)], val=train, eval_resolution=16,
                     val_crop_ratio=0.875, block_rows=2 * BATCH, map_concurrency=2)


def serve(spec: IngestSpec, world: int, epoch: int = 0, step: int = 0) -> list[list[dict]]:
    """Per rank, the batches the worker loop would take (rank's slice of each global step), from (epoch, step)."""
    ds = make_blocks_dataset(phase_blocks(spec, 0, epoch, step))
    iters = PlanDataConfig(spec).configure({"train_p0": ds}, world, None, None)
    out = []
    for r in range(world):
        lo, hi = rank_slice(BATCH, world, r)
        out.append(list(iters[r]["train_p0"].iter_batches(batch_size=hi - lo, batch_format="numpy",
                                                          prefetch_batches=1)))
    return out


def global_steps(per_rank: list[list[dict]]) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(epoch, sample ids, images) of every global step, the ranks' slices joined in rank order."""
    steps = []
    for parts in zip(*per_rank, strict=True):
        epochs = {int(e) for p in parts for e in p["epoch"]}
        assert len(epochs) == 1  # a rank's batch never straddles two epochs
        steps.append((epochs.pop(), np.concatenate([p["sample_id"] for p in parts]),
                      np.concatenate([p["image"] for p in parts])))
    return steps


def test_every_worker_count_trains_the_same_global_samples_per_step_and_epoch(spec):
    n_steps = spec.train_size // BATCH
    runs = {w: global_steps(serve(spec, w)) for w in (1, 2, 3)}
    plan = EpochPlan(spec.phases[0].shards.rows, spec.seed)
    id_of_row = np.concatenate([np.asarray(c) for c in _ids_by_row(spec)])
    for w, steps in runs.items():
        assert len(steps) == EPOCHS * n_steps, w
        for e in range(EPOCHS):
            ids = np.concatenate([s[1] for s in steps if s[0] == e])
            assert len(ids) == n_steps * BATCH and len(set(ids.tolist())) == len(ids)  # no repeats in an epoch
            assert np.array_equal(ids, id_of_row[plan.order(e)[:n_steps * BATCH]])  # exactly the plan's order
        for a, b in zip(steps, runs[1], strict=True):
            assert a[0] == b[0] and np.array_equal(a[1], b[1])
            assert np.array_equal(a[2], b[2])  # same crops and flips too: the draws follow the sample
    e0 = {int(i) for s in runs[1] if s[0] == 0 for i in s[1]}
    e1 = {int(i) for s in runs[1] if s[0] == 1 for i in s[1]}
    assert e0 != e1  # a different tail is left out each epoch


def test_a_resume_mid_epoch_serves_exactly_the_samples_not_yet_trained(spec):
    full = global_steps(serve(spec, 2))
    done_steps = 2  # interrupted after 2 global steps of epoch 0; resumed with 3 workers
    resumed = global_steps(serve(spec, 3, epoch=0, step=done_steps))
    assert len(resumed) == len(full) - done_steps
    trained = {int(i) for _, ids, _ in full[:done_steps] for i in ids}
    rest_of_epoch0 = [int(i) for e, ids, _ in resumed if e == 0 for i in ids]
    assert not trained & set(rest_of_epoch0)  # nothing served twice
    full_epoch0 = [int(i) for e, ids, _ in full if e == 0 for i in ids]
    assert sorted(trained | set(rest_of_epoch0)) == sorted(full_epoch0)  # and nothing missed
    for a, b in zip(resumed, full[done_steps:], strict=True):  # the continuation is the uninterrupted run
        assert a[0] == b[0] and np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2])


def _ids_by_row(spec: IngestSpec) -> list[list[int]]:
    import pyarrow.parquet as pq

    return [pq.read_table(u, columns=["sample_id"]).column(0).to_pylist() for u in spec.phases[0].shards.uris]
