"""The inter-node bytes figure of bench.comm (dense over hierarchical top-k) and the crossover model's sparse payload
sizes: the arithmetic, on known byte counts."""

from __future__ import annotations

import math

import pytest

from bench.comm import inter_node_bytes_figure
from lightray.comm import auto as comm_auto
from lightray.comm.compress import INDEX_BLOCK

N_RESNET50 = 25_557_032


def test_modelled_payload_bytes_are_four_per_entry_plus_a_count_per_index_block_for_compact():
    s = comm_auto.StepCosts(elements=8_000_000, buckets=2, ratio=0.001, compress_s=0.0, payload="compact")
    k = 0.001 * 8_000_000
    blocks = 2 * 8 * math.ceil(8_000_000 / (2 * 8 * INDEX_BLOCK))  # 2 buckets x 8 chunks
    assert comm_auto.sparse_payload_bytes(s, 8) == pytest.approx(4 * k + 4 * blocks)
    fp32 = comm_auto.StepCosts(elements=8_000_000, buckets=2, ratio=0.001, compress_s=0.0)
    assert fp32.payload == "fp32" and comm_auto.sparse_payload_bytes(fp32, 8) == pytest.approx(8 * k)
    c = comm_auto.Cluster(16, 8, 25.0)
    assert comm_auto.parts("hierarchical_topk", c, s)["inter_bytes"] == pytest.approx(15 * (4 * k + 4 * blocks))


def _pass(b_node: dict[tuple[float, str], int], dense: int, per_node: int) -> dict:
    out = {"dense": {"by_group": {"world": dense}, "modelled_inter_node": 0}}
    for (ratio, payload), b in b_node.items():
        out[f"hierarchical_topk/{ratio:g}/{payload}"] = {"by_group": {"cross_node": b // per_node},
                                                         "modelled_inter_node": 0}
    return out


def test_inter_node_figure_models_125x_at_ratio_0001_compact_and_derives_the_counted_ratio_per_node_link():
    s_bytes = 4 * N_RESNET50
    counted = {(0.01, "compact"): 1_030_000, (0.01, "fp32"): 2_045_000,
               (0.001, "compact"): 103_000, (0.001, "fp32"): 204_500}
    fig, goal = inter_node_bytes_figure("resnet50", N_RESNET50, _pass(counted, s_bytes, 2), 2, 2)
    m = fig["modelled"]
    # dense's 2 (N-1)/N S over (N-1) x ratio x n x bytes an entry: 1 / (N ratio) x 8 / bytes an entry
    assert m["0.001"]["fp32"]["hierarchical_dense_over_hierarchical_topk"] == pytest.approx(62.5, abs=0.01)
    assert m["0.01"]["fp32"]["hierarchical_dense_over_hierarchical_topk"] == pytest.approx(6.25, abs=0.01)
    assert 120 < m["0.001"]["compact"]["hierarchical_dense_over_hierarchical_topk"] < 125  # counts cost a little
    assert 12 < m["0.01"]["compact"]["hierarchical_dense_over_hierarchical_topk"] < 12.5
    got = fig["counted"]["0.001"]["compact"]
    assert got["cross_node_bytes_handed_per_node"] == 103_000
    assert got["dense_over_hierarchical_topk_at_16_nodes"] == pytest.approx(2 * s_bytes / (16 * 103_000), abs=0.01)
    assert got["dense_over_hierarchical_topk_at_2_nodes_here"] == pytest.approx(2 * s_bytes / (2 * 103_000), abs=0.01)
    assert goal["ratio_0.001"]["holds"] and not goal["ratio_0.01"]["holds"]


def test_bytes_goal_does_not_hold_when_the_counted_figure_falls_short_of_the_model():
    s_bytes = 4 * N_RESNET50
    # counted at 8 bytes an entry under the compact label (a payload that did not shrink): 62x, not 100x
    counted = {(0.001, "compact"): 204_500, (0.01, "compact"): 2_045_000}
    _, goal = inter_node_bytes_figure("resnet50", N_RESNET50, _pass(counted, s_bytes, 2), 2, 2)
    assert goal["ratio_0.001"]["modelled"] > 100
    assert goal["ratio_0.001"]["counted"] < 100 and not goal["ratio_0.001"]["holds"]
