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
    # Per-core figures for every path, the device path labelled with the device it ran on, cores per GPU.
    cores = res["machine"]["cores"]
    for path, v in (("cpu_aug_shard", "shard"), ("cpu_aug_object", "object"), ("device_aug", "device")):
        assert fig["per_core_img_s"][path]["32"] == pytest.approx(fig[f"{v}_32px_images_per_s"] / cores, abs=0.1)
        assert fig["cores_per_gpu"][path] == pytest.approx(6319 / fig["per_core_img_s"][path]["32"], rel=0.02)
    assert fig["device_op_32px_images_per_s"] > 0 and fig["device_op_device"] in ("cpu", "cuda")
    assert fig["device_path_device"].startswith(fig["device_op_device"])
    assert res["ratios"]["device_aug_over_cpu_aug_32px"] == pytest.approx(
        fig["device_32px_images_per_s"] / fig["shard_32px_images_per_s"], rel=0.02, abs=0.01)
