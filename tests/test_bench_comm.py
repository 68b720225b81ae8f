"""The comm benchmark's own arithmetic: buckets, overlap share, the projection and crossover through the shared
crossover model, handed-byte counting per process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import bench.comm as bench_comm
from bench.comm import PROJECTED_MODES, _buckets, _Handed, _overlap, crossover_here, project
from lightray.comm import auto as comm_auto


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
    assert res["window_s"] == pytest.approx(1.0)  # first hook call to the last: the compute left to hide behind
    assert res["buckets"][0] == {"bucket": 0, "call_ms": 500.0, "done_ms": 2500.0}
    assert _overlap([(0, 1.0, 1.0)], 0.0)["overlap_frac"] == 0.0  # a synchronous hook overlaps nothing


def test_projection_writes_its_model_and_inputs_and_compares_both_dense_all_reduces():
    proj = project("resnet50", 25_557_032, 2_000_000, compress_s=0.05, cast_s=0.01, window_share=0.9,
                   compress_source="test figures")
    assert set(proj["modes"]) == set(PROJECTED_MODES) and "hierarchical_dense" in proj["modes"]
    assert proj["model"] == comm_auto.FORMULA and "max(0, async_s(mode) - overlap_s)" in proj["model"]
    costs = proj["inputs"]["costs"]
    assert costs["compute_s"] == pytest.approx(256 / 1200) and costs["compress_s"] == 0.05
    assert costs["overlap_s"] == pytest.approx(256 / 1200 * 2 / 3 * 0.9)  # measured share of the modelled backward
    assert proj["inputs"]["cluster"]["nodes"] == 16 and proj["inputs"]["cluster"]["link_gbps"] == 25.0
    assert proj["inputs"]["sources"]["compress_s / cast_s"] == "test figures"
    dense, hier = proj["modes"]["dense"], proj["modes"]["hierarchical_dense"]
    assert hier["inter_node_bytes"] < dense["inter_node_bytes"]
    # the step is the shared model's: the bench and comm.mode=auto cannot disagree
    c = comm_auto.Cluster(**proj["inputs"]["cluster"])
    s = comm_auto.StepCosts(**costs)
    for mode, row in proj["modes"].items():
        assert row["step_s"] == pytest.approx(comm_auto.step_s(mode, c, s), abs=1e-6)
        assert row["efficiency"] == pytest.approx(costs["compute_s"] / row["step_s"], rel=1e-3)
    assert proj["modes"]["hierarchical_topk"]["crossover_gbps"] == comm_auto.crossover_gbps("hierarchical_topk", c, s)
    assert proj["auto_picks"] in ("dense", "bf16", "hierarchical_topk") and proj["auto_why"].startswith("picked")


def test_crossover_here_is_where_the_mode_and_dense_steps_meet():
    out = crossover_here(11_689_512, 4, compress_s=0.2, cast_s=0.02, overlap_s=0.01, compute_s=0.5)
    x = out["gbps"]["hierarchical_topk"]
    assert x is not None and 0 < x < 100
    costs = comm_auto.StepCosts(**out["inputs"]["costs"])
    at = comm_auto.Cluster(2, 2, x, comm_auto.INTRA_GBPS["cpu"])
    assert comm_auto.step_s("hierarchical_topk", at, costs) == pytest.approx(comm_auto.step_s("dense", at, costs),
                                                                              rel=1e-3)
    assert out["inputs"]["cluster"]["link_gbps"] == "solved for"


def test_handed_bytes_count_the_tensors_given_to_collectives(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    orig = (dist.all_reduce, dist.all_gather)
    try:
        handed = _Handed()
        dist.all_reduce(torch.zeros(10))
        parts = [torch.empty(3, dtype=torch.float64)]
        dist.all_gather(parts, torch.ones(3, dtype=torch.float64))
        assert handed.bytes == 10 * 4 + 3 * 8
        assert handed.by_group == {"world": 10 * 4 + 3 * 8}
        node = dist.new_group([0])
        handed.names = {id(node): "node"}
        dist.all_reduce(torch.zeros(5), group=node)
        assert handed.by_group == {"world": 64, "node": 20} and handed.bytes == 84
        assert torch.equal(parts[0], torch.ones(3, dtype=torch.float64))
    finally:
        dist.all_reduce, dist.all_gather = orig
        dist.destroy_process_group()


def test_the_16_node_bytes_are_labelled_modelled_and_the_crossover_says_where_compression_was_timed(monkeypatch):
    """Until the suite has run on a GPU, the crossover's compression costs are a CPU's and the 16-node inter-node
    bytes are a formula over two simulated nodes: the JSON must say both."""
    n = 1_000_000
    counted = {"dense": {"by_group": {"world": 4 * n}, "modelled_inter_node": 0}}
    for ratio in bench_comm.BYTES_RATIOS:
        for payload in ("compact", "fp32"):
            counted[f"hierarchical_topk/{ratio:g}/{payload}"] = {"by_group": {"cross_node": int(4 * ratio * n)},
                                                                 "modelled_inter_node": 0}
    fig, _ = bench_comm.inter_node_bytes_figure("resnet50", n, counted, 2, 2)
    got = bench_comm.inter_node_bytes_16_nodes(fig, "resnet50")
    assert got["kind"] == "modelled" and got["value"] > 0
    assert got["value"] == fig["modelled"]["0.01"]["compact"]["hierarchical_topk_inter_node_bytes"]
    # The whole main() with the gloo part stubbed out: the labels sit in the emitted JSON.
    lines = []
    fake = {"elements": n, "seconds": {"exact": 0.2, "sampled": 0.01, "sampled_dgc": 0.02,
                                       "sampled_dgc_per_layer": 0.02}, "cast_bf16_s": 0.001,
            "forward_backward_s": 1.0, "frac_sampled": 0.01}
    step = {"handed_bytes": 4 * n, "handed_by_group": {"world": 4 * n}, "bytes": 4 * n, "inter_bytes": 2 * n,
            "step_s": 0.1, "backward_s": 0.05, "overlap_frac": 0.5, "window_share": 0.8, "buckets": [], "comm_s": 0.01}
    monkeypatch.setattr(bench_comm, "compress_overhead", lambda *a, **k: fake)
    monkeypatch.setattr(bench_comm, "measure", lambda arch, w, s: {"bytes_pass": counted, "elements": n, "dense": step,
                                                                   **{m: step for m in bench_comm.MODES}})
    monkeypatch.setattr(bench_comm.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench_comm, "emit", lambda b, f, r, m: lines.append(f))
    bench_comm.main(["--models", "resnet18", "--workers", "2"])
    figures = lines[0]
    assert figures["compression_cost_measured_on"] == "cpu"
    assert "measured on cpu" in figures["crossover_gbps_for"]
    assert figures["inter_node_bytes_16_nodes"]["kind"] == "modelled"
