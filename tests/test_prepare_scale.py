"""``python -m bench.prepare_scale`` at its smallest sizes: one JSON line, every figure per size, ratios that
agree with the figures. Speed itself is the bench's business, never a test's."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SIZE_KEYS = {"files", "prepare_s", "s_per_1k_files", "images_per_s", "driver_peak_rss_mb", "driver_rss_growth_mb",
             "driver_peak_pss_mb", "manifest_bytes", "shard_files"}


@pytest.mark.slow  # the bench end to end
@pytest.mark.shares_cpu
def test_prepare_scale_reports_each_size_and_the_ratios(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench.prepare_scale", "--sizes", "120,360", "--classes", "6",
                          "--cpus", "2", "--workdir", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stdout[-3000:]
    res = json.loads(lines[0])
    assert res["bench"] == "prepare_scale" and set(res) == {"bench", "figures", "ratios", "machine"}
    sizes = res["figures"]["sizes"]
    assert [s["files"] for s in sizes] == [120, 360]
    for s in sizes:
        assert SIZE_KEYS <= set(s), SIZE_KEYS - set(s)
        assert s["prepare_s"] > 0 and s["driver_peak_rss_mb"] > 0 and s["manifest_bytes"] > 0
        # Both tiers of every shard: one shard of <= 512 rows per 512 files.
        assert s["shard_files"] == 2 * -(-s["files"] // 512)
    ratios = res["ratios"]
    assert ratios["files_largest_over_smallest"] == 3.0
    want = sizes[1]["s_per_1k_files"] / sizes[0]["s_per_1k_files"]
    assert abs(ratios["per_file_time_largest_over_smallest"] - want) < 0.01 * want + 1e-3
    assert ratios["lightray_over_pool_prepare"] > 0 and res["figures"]["pool_images_per_s"] > 0
    assert ratios["driver_rss_growth_largest_over_smallest"] > 0
    assert "prepare_scale" in res["machine"]["command"]
