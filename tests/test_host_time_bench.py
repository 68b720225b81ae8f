"""``python -m bench.host_time --quick``: lightray's real Trainer step against a plain DDP step in one process
(a gloo group of one), at the quick size. Checks the bench's shape and that its timers saw the trainer's own
calls; how many milliseconds lightray adds is the bench's business, never a test's."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.host_time import PARTS, per_step_ms
from tests.test_benches import REPO


def test_host_time_bench_times_both_steps_and_breaks_lightrays_down_by_its_own_calls():
    out = subprocess.run([sys.executable, "-m", "bench.host_time", "--quick"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stdout[-3000:]
    res = json.loads(lines[0])
    fig, rat = res["figures"], res["ratios"]
    assert res["bench"] == "host_time" and fig["comm_mode"] == "dense" and fig["torch_threads"] == 1
    pairs = fig["plain_ms_per_step"]["n"]
    assert pairs == fig["lightray_ms_per_step"]["n"] == rat["added_ms_per_step"]["n"] == 2
    for p, q, a in zip(fig["plain_ms_per_step"]["runs"], fig["lightray_ms_per_step"]["runs"],
                       rat["added_ms_per_step"]["runs"]):
        assert p > 0 and q > 0 and abs((q - p) - a) < 1e-3
    # Every part was timed in every pair; the timed steps (40 at --quick) each made their calls, and one in
    # report_every of them was a report step.
    assert set(fig["parts_ms_per_step"]) == set(PARTS) | {"comm_hook"}
    calls, steps = fig["calls_in_timed_steps"], fig["steps"]
    assert calls["prefetch_handover"] == calls["inputs"] == calls["checkpoint_checks_and_agreement"] == steps
    assert calls["report_steps"] == steps // fig["report_every"]
    assert calls["schedule"] == 5 * steps  # lr, momentum, the comm hook's step, its momentum, setting them
    assert all(v["n"] == pairs and v["min"] >= 0 for v in fig["parts_ms_per_step"].values())
    assert fig["parts_ms_per_step"]["comm_hook"]["min"] > 0 and fig["parts_ms_per_step"]["report_steps"]["min"] > 0


def test_per_step_time_leaves_out_the_slowest_twentieth_of_the_gaps():
    starts = [0.0]
    for i in range(40):  # 1 ms steps, one 50 ms time slice taken by another process
        starts.append(starts[-1] + (0.050 if i == 7 else 0.001))
    assert abs(per_step_ms(starts, warmup=0) - 1.0) < 1e-9
    assert abs(per_step_ms(starts, warmup=0, trim=0.0) - (39 + 50) / 40) < 1e-9
