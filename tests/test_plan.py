import numpy as np

from lightray.data.plan import EpochPlan, rank_slice


def test_each_epoch_is_a_permutation_and_epochs_differ():
    plan = EpochPlan([5, 7, 3, 9], seed=1)
    a, b = plan.order(0), plan.order(1)
    assert sorted(a.tolist()) == list(range(24)) and sorted(b.tolist()) == list(range(24))
    assert not np.array_equal(a, b)
    assert np.array_equal(a, EpochPlan([5, 7, 3, 9], seed=1).order(0))


def test_order_keeps_shards_contiguous():
    plan = EpochPlan([4, 4, 4], seed=0)
    shard, _ = plan.to_shard_row(plan.order(2))
    runs = [shard[i] for i in range(len(shard)) if i == 0 or shard[i] != shard[i - 1]]
    assert sorted(runs) == [0, 1, 2]  # each shard appears in one run


def test_global_set_per_step_is_the_same_for_1_2_and_3_workers():
    plan = EpochPlan([50, 50, 28], seed=4)
    batch = 30
    for step in range(128 // batch):
        rows = plan.step_rows(3, step, batch)
        for world in (1, 2, 3):
            parts = [rows[slice(*rank_slice(batch, world, r))] for r in range(world)]
            assert np.array_equal(np.concatenate(parts), rows)


def test_rank_slices_tile_the_batch_even_when_uneven():
    for batch in (1, 7, 64):
        for world in (1, 2, 3, 5):
            if world > batch:
                continue
            spans = [rank_slice(batch, world, r) for r in range(world)]
            assert spans[0][0] == 0 and spans[-1][1] == batch
            assert all(spans[i][1] == spans[i + 1][0] for i in range(world - 1))
            assert max(e - s for s, e in spans) - min(e - s for s, e in spans) <= 1


def test_prepared_shards_mix_classes(tmp_path, ray_local):
    """The plan reads shard by shard, so each shard must hold a mix of classes, not a run of one class."""
    import pyarrow.parquet as pq

    from lightray.data.demo import generate_demo
    from lightray.data.manifest import Manifest
    from lightray.data.prepare import prepare

    src = generate_demo(tmp_path / "src", seed=0, num_classes=4, train_per_class=40, val_per_class=4)
    man = Manifest.load(str(prepare(str(src), str(tmp_path / "cache"), [32], shard_rows=40)))
    for shard in man.shards("train", 32):
        labels = pq.read_table(shard.uri, columns=["label"]).column(0).to_pylist()
        assert len(set(labels)) >= 3, labels
