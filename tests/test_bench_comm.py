"""The comm benchmark's own arithmetic: buckets, overlap share, crossover bandwidth, handed-byte counting."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bench.comm import _buckets, _Handed, _overlap, crossover_gbps


def test_buckets_cover_every_parameter_once_in_reverse_order_within_the_cap():
    model = torch.nn.Sequential(*[torch.nn.Linear(100, 100) for _ in range(6)])
    buckets = _buckets(model, bucket_mb=0.1)  # 26214 floats: two layers (2 x 10100) per bucket
    names = [n for b in buckets for n, _ in b]
    assert names == [n for n, _ in reversed(list(model.named_parameters()))]
    assert all(sum(k for _, k in b) <= 0.1 * 1024 * 1024 / 4 for b in buckets)
    assert len(buckets) == 3


def test_overlap_counts_collective_time_before_the_last_hook_call():
    # Bucket 0 runs 1.0 -> 3.0 while backward goes on until the last call at 2.0; bucket 1 runs 2.0 -> 2.5.
    res = _overlap([(0, 1.0, 3.0), (1, 2.0, 2.5)], t_backward=0.5)
    assert res["overlap_frac"] == pytest.approx(1.0 / 2.5)
    assert res["buckets"][0] == {"bucket": 0, "call_ms": 500.0, "done_ms": 2500.0}
    assert _overlap([(0, 1.0, 1.0)], 0.0)["overlap_frac"] == 0.0  # a synchronous hook overlaps nothing


def test_crossover_is_where_saved_bytes_cost_as_long_as_the_extra_compute():
    # 100 MB saved per step, 0.1 s of compression compute: 8e8 bit / 0.1 s = 8 Gbit/s.
    assert crossover_gbps(101e6, 1e6, 0.1) == pytest.approx(8.0)
    assert crossover_gbps(1e6, 2e6, 0.1) is None  # sends more than dense: never faster
    assert crossover_gbps(2e6, 1e6, 0.0) is None


def test_handed_bytes_count_the_tensors_given_to_collectives(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    orig = (dist.all_reduce, dist.all_gather)
    try:
        handed = _Handed()
        dist.all_reduce(torch.zeros(10))
        parts = [torch.empty(3, dtype=torch.float64)]
        dist.all_gather(parts, torch.ones(3, dtype=torch.float64))
        assert handed.bytes == 10 * 4 + 3 * 8
        assert torch.equal(parts[0], torch.ones(3, dtype=torch.float64))
    finally:
        dist.all_reduce, dist.all_gather = orig
        dist.destroy_process_group()
