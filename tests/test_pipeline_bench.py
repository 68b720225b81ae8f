"""A correctness run of ``python -m bench.pipeline`` at tiny size: one JSON line, every variant measured,
ratios consistent with the figures (speed itself is the bench's business, not a test's)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_pipeline_bench_prints_one_json_line_with_every_variant():
    out = subprocess.run([sys.executable, "-m", "bench.pipeline", "--quick", "--images", "48", "--sizes", "32",
                          "--workers", "2"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stdout
    res = json.loads(lines[0])
    assert res["bench"] == "pipeline" and set(res) == {"bench", "figures", "ratios", "machine"}
    fig = res["figures"]
    for v in ("baseline", "cold", "shard", "object"):
        assert fig[f"{v}_32px_images_per_s"] > 0 and fig[f"{v}_32px_peak_mb"] > 0
    for v in ("cold", "shard", "object"):
        want = fig[f"{v}_32px_images_per_s"] / fig["baseline_32px_images_per_s"]
        assert res["ratios"][f"{v}_over_baseline_32px"] == pytest.approx(want, rel=0.02, abs=0.01)
