"""``python -m bench.chaos`` at its smallest size: one run under every fault kind once (node losses twice
added back), every fault survived, the exactly-once audit exact, the JSON line complete."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.chaos import KINDS, PRIMARY, fault_plan, trigger_points
from tests.faults import ROOT


def test_fault_plan_is_seeded_and_adds_a_node_back_after_each_loss():
    plan = fault_plan(3)
    assert plan == fault_plan(3) and sorted(set(plan)) == sorted(KINDS)
    assert len({tuple(fault_plan(seed)) for seed in range(10)}) > 1  # the seed moves the order
    for i, kind in enumerate(plan):
        if kind in ("node_kill", "preemption"):
            assert plan[i + 1] == "node_add"
    assert plan.count("node_add") == 2 and len(plan) == len(PRIMARY) + 2


def test_trigger_points_are_sorted_inside_the_run():
    points = trigger_points(0, 5, 2048)
    assert points == sorted(points) and all(0.1 * 2048 <= p <= 0.6 * 2048 for p in points)
    assert points == trigger_points(0, 5, 2048)


@pytest.mark.slow
def test_chaos_soak_survives_every_fault_with_an_exact_audit(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench.chaos", "--minutes", "0", "--seed", "0",
                          "--keep", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=3000)
    assert out.returncode == 0, out.stderr[-6000:]
    (line,) = out.stdout.strip().splitlines()
    result = json.loads(line)
    faults = result["figures"]["faults"]
    assert set(faults) == set(KINDS)
    for kind, row in faults.items():
        assert set(row) == {"injected", "survived", "lost_samples", "restart_s"}, kind
        assert row["injected"] == (2 if kind == "node_add" else 1), (kind, result["figures"]["injections"])
        assert row["survived"] == row["injected"], (kind, result["figures"]["injections"])
    # A noticed preemption checkpoints at the notice: nothing is trained twice.
    assert faults["preemption"]["lost_samples"] == 0
    assert result["figures"]["audit_exact"] is True, result["figures"]["audit_diff"]
    assert result["figures"]["status"] == "finished"
    assert result["ratios"]["top1_over_uninterrupted"] is not None
