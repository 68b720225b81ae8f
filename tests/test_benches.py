"""Correctness runs of ``python -m bench.overhead`` and ``python -m bench.time_to_accuracy`` at tiny size:
exactly one JSON line on stdout, of the agreed shape, both sides really trained, ratios consistent with
the figures. Speed itself is the benches' business, never a test's.

Each bench starts a real local Ray cluster and a real TorchTrainer with 2 gloo workers (and the plain
side real gloo processes / a real DataLoader over JPEG files), so each takes minutes on the shared
2-core machine: both are marked slow.
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import pytest

from bench.common import emit, module_name, ratio, read_jsonl

REPO = pathlib.Path(__file__).resolve().parents[1]
MACHINE_KEYS = {"cores", "memory_gib", "load_avg_1m_at_start", "load_avg_1m_at_end", "torch", "ray", "git",
                "command"}


def _one_json_line(args: list[str], timeout: int = 900) -> dict:
    out = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one JSON line on stdout, got {len(lines)}:\n{out.stdout[-3000:]}"
    res = json.loads(lines[0])
    assert set(res) == {"bench", "figures", "ratios", "machine"}
    assert MACHINE_KEYS <= set(res["machine"]), set(res["machine"])
    return res


@pytest.mark.slow
def test_overhead_bench_trains_both_sides_the_same_steps_and_reports_their_ratio():
    res = _one_json_line(["bench.overhead", "--quick"])
    fig = res["figures"]
    assert res["bench"] == "overhead"
    assert fig["plain_steps_done"] == fig["steps"] == fig["lightray_steps_done"]
    for side in ("plain", "lightray"):
        assert fig[f"{side}_steps_per_s"] > 0
        first, last = fig[f"{side}_loss_first_last"]
        assert math.isfinite(first) and math.isfinite(last) and 0 < first < 10
    assert len(fig["plain_steps_per_s_runs"]) == 2
    assert fig["lightray_val_samples"] > 0  # the end-of-epoch validation ran through the in-memory stream
    want = fig["lightray_steps_per_s"] / fig["plain_steps_per_s"]
    assert res["ratios"]["lightray_over_plain_steps_per_s"] == pytest.approx(want, rel=0.01)
    assert res["machine"]["command"] == "python -m bench.overhead --quick"


@pytest.mark.slow
def test_time_to_accuracy_bench_reaches_a_low_target_on_both_sides(tmp_path):
    # A target any trained model passes on epoch 1: both sides report a time, so the ratios are numbers.
    res = _one_json_line(["bench.time_to_accuracy", "--quick", "--target", "0.01", "--storage", str(tmp_path)])
    fig = res["figures"]
    assert res["bench"] == "time_to_accuracy"
    for side in ("baseline", "lightray"):
        assert fig[f"{side}_reached"] is True and fig[f"{side}_epochs_to_target"] == 1
        assert 0 < fig[f"{side}_train_s_to_target"] <= fig[f"{side}_wall_s_to_target"] <= fig[f"{side}_total_wall_s"]
        assert fig[f"{side}_best_top1"] >= 0.01 and len(fig[f"{side}_top1_per_epoch"]) == 1
    assert fig["val_images"] == 60 and fig["train_images"] == 120  # quick demo: 10 classes x (12 train, 6 val)
    assert res["ratios"]["baseline_over_lightray_train_s_to_target"] == pytest.approx(
        fig["baseline_train_s_to_target"] / fig["lightray_train_s_to_target"], rel=0.02)
    # lightray's run folder holds the validation record the time was read from
    vals = [r for r in read_jsonl(pathlib.Path(fig["lightray_run_dir"]) / "metrics.jsonl") if "val_top1" in r]
    assert vals and vals[0]["val_top1"] == pytest.approx(fig["lightray_top1_per_epoch"][0], abs=1e-4)


def test_emit_prints_exactly_one_parseable_line(capsys):
    emit("x", {"a": 1.5}, {"a_over_b": 2.0}, {"cores": 2})
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert json.loads(out) == {"bench": "x", "figures": {"a": 1.5}, "ratios": {"a_over_b": 2.0},
                               "machine": {"cores": 2}}


def test_ratio_is_none_when_a_side_has_no_figure():
    assert ratio(None, 2.0) is None and ratio(2.0, None) is None and ratio(1.0, 0.0) is None
    assert ratio(3.0, 2.0) == 1.5


def test_module_name_turns_the_script_path_back_into_the_module():
    assert module_name(str(REPO / "bench" / "overhead.py")) == "bench.overhead"


def test_read_jsonl_skips_a_line_cut_short(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert read_jsonl(p) == [{"step": 1}, {"step": 2}]


def test_overhead_rejects_a_warmup_that_is_not_a_report_step():
    out = subprocess.run([sys.executable, "-m", "bench.overhead", "--steps", "20", "--warmup", "3",
                          "--report-every", "5"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "--warmup=3" in out.stderr and "multiple of --report-every=5" in out.stderr
