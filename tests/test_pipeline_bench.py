"""What a correctness run of ``python -m bench.pipeline`` at tiny size must show: one JSON line, every variant
measured, ratios consistent with the figures (speed itself is the bench's business, not a test's). The run is the
GPU suite dry run's pipeline step (tests/test_gpu_suite.py)."""

from __future__ import annotations

import pathlib

import pytest
from PIL import Image

from bench.pipeline import make_source, resize_copy

REPO = pathlib.Path(__file__).resolve().parents[1]


def check_pipeline(res: dict) -> None:
    """What a quick run at 32 px must show: read from the GPU suite's dry run, whose pipeline step runs
    ``bench.pipeline --quick --images 48 --sizes 32 --workers 2 --epochs 2`` (tests/test_gpu_suite.py); also usable
    on a line saved from a run by hand."""
    assert res["bench"] == "pipeline" and set(res) == {"bench", "figures", "ratios", "machine"}
    fig, rat = res["figures"], res["ratios"]
    for v in ("dataloader_original", "dataloader_resized", "cold", "shard", "object"):
        assert fig[f"{v}_32px_images_per_s"] > 0 and fig[f"{v}_32px_peak_mb"] > 0
    # Both DataLoader baselines: cold first pass apart from the steady passes; the resized copy's cold figure
    # pays its resize, so it is slower than its own first pass alone.
    for b in ("original", "resized"):
        assert fig[f"dataloader_{b}_32px_cold_images_per_s"] > 0
        for v in ("shard", "object"):
            want = fig[f"{v}_32px_images_per_s"] / fig[f"dataloader_{b}_32px_images_per_s"]
            assert rat[f"{v}_vs_dataloader_{b}_32px"] == pytest.approx(want, rel=0.02, abs=0.01)
        want = fig["cold_32px_images_per_s"] / fig[f"dataloader_{b}_32px_cold_images_per_s"]
        assert rat[f"cold_vs_dataloader_{b}_cold_32px"] == pytest.approx(want, rel=0.02, abs=0.01)
    assert fig["dataloader_resized_32px_resize_s"] > 0 and fig["dataloader_resized_32px_resize_peak_mb"] > 0
    assert fig["dataloader_resized_32px_cold_images_per_s"] < fig["dataloader_resized_32px_first_pass_images_per_s"]
    assert not any("over_baseline" in k for k in rat)
    # Per-core figures for every path, the device path labelled with the device it ran on, cores per GPU.
    cores = res["machine"]["cores"]
    for path, v in (("cpu_aug_shard", "shard"), ("cpu_aug_object", "object"), ("device_aug", "device"),
                    ("device_decode", "device_decode")):
        assert fig["per_core_img_s"][path]["32"] == pytest.approx(fig[f"{v}_32px_images_per_s"] / cores, abs=0.1)
        assert fig["cores_per_gpu"][path] == pytest.approx(6319 / fig["per_core_img_s"][path]["32"], rel=0.02)
    assert fig["device_op_32px_images_per_s"] > 0 and fig["device_op_device"] in ("cpu", "cuda")
    assert fig["device_path_device"].startswith(fig["device_op_device"])
    # Device decode: the consumer decoded and cropped every delivered batch, on the device it names.
    assert fig["device_decode_op_32px_images_per_s"] > 0 and fig["device_decode_32px_peak_mb"] > 0
    assert fig["device_decode_device"].split(":")[0] == fig["device_op_device"]
    assert res["ratios"]["device_decode_over_cpu_aug_32px"] == pytest.approx(
        fig["device_decode_32px_images_per_s"] / fig["shard_32px_images_per_s"], rel=0.02, abs=0.01)
    # Ray Data's knobs chosen per variant as a run chooses them (48 images: below the calibration minimum, so the
    # defaults a run would take), and recorded.
    for v in ("cold", "shard", "object", "device", "device_decode"):
        tuned = fig[f"{v}_32px_autotune"]
        assert tuned["block_rows"] > 0 and tuned["cpus"] > 0 and tuned["seconds"] >= 0
    # Ray Data's own account of each lightray variant's map operator: tasks, how many ran at once, CPU per image.
    for v in ("shard", "object", "device", "device_decode"):
        rd = fig[f"{v}_32px_ray_data"]
        assert rd["tasks"] >= 1 and rd["rows_per_task"] > 0 and rd["task_wall_s_mean"] > 0
        assert 0 < rd["tasks_in_flight_mean"] <= 2 * cores + 0.5 and rd["task_cpu_ms_per_image"] > 0
    # The gap breakdown: per-image work on one core for both sides, and what each pipeline makes of its cores;
    # the two ratios multiply to the delivered one.
    for side in ("shard", "dataloader_resized"):
        assert fig[f"{side}_32px_one_process_images_per_s"] > 0 and fig[f"{side}_32px_pipeline_efficiency"] > 0
    work = rat["work_per_image_shard_vs_dataloader_resized_32px"]
    eff = rat["pipeline_efficiency_shard_vs_dataloader_resized_32px"]
    assert work * eff == pytest.approx(fig["shard_32px_images_per_s"] / fig["dataloader_resized_32px_images_per_s"],
                                       rel=0.03)
    assert res["ratios"]["device_aug_over_cpu_aug_32px"] == pytest.approx(
        fig["device_32px_images_per_s"] / fig["shard_32px_images_per_s"], rel=0.02, abs=0.01)


def test_resize_copy_gives_every_image_the_short_side_asked_for_keeping_its_aspect(tmp_path):
    src = make_source(tmp_path / "src", n_train=6, size=(200, 150))
    secs, peak = resize_copy(src, tmp_path / "dst", 48, workers=2)
    assert secs > 0 and peak > 0
    for path in sorted((src / "train").rglob("*.jpg")):
        with Image.open(path) as a, Image.open(tmp_path / "dst" / path.relative_to(src)) as b:
            assert min(b.size) == 48
            assert b.size[0] / b.size[1] == pytest.approx(a.size[0] / a.size[1], rel=0.05)
