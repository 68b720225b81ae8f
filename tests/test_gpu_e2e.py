"""bench/gpu_e2e.sh, the whole-stack GPU check, where this machine can check it: the script parses, its
per-phase figures and its diagnosis of a starved phase follow from the run's metrics. Its dry run, which drives
the real `app/run.py` and the synthetic step on CPU through three phases to one JSON line, is the e2e step of
the GPU suite's dry run (tests/test_gpu_suite.py)."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

from bench.gpu_e2e import GOAL, phase_figures, run_args, starved_by

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_gpu_e2e_script_is_valid_bash():
    out = subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_e2e.sh")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_phase_figures_skip_the_compile_window_and_keep_each_phase_apart():
    recs = [{"event": "unit", "unit": "augment_on"},
            {"resolution": 128, "images_per_s": 10.0, "data_wait_frac": 0.9, "time": 100.0},  # compile window
            {"resolution": 128, "images_per_s": 900.0, "data_wait_frac": 0.02, "time": 110.0},
            {"resolution": 128, "images_per_s": 1000.0, "data_wait_frac": 0.04, "time": 120.0},
            {"resolution": 128, "val_top1": 0.1},
            {"resolution": 224, "images_per_s": 5.0, "data_wait_frac": 0.5, "time": 130.0},
            {"resolution": 224, "images_per_s": 400.0, "data_wait_frac": 0.3, "time": 140.0}]
    got = phase_figures(recs, [(128, 256, 0.35), (224, 192, 0.1), (288, 128, 0.5)])
    assert got[128]["e2e_img_s"] == 950.0 and got[128]["data_wait_frac"] == pytest.approx(0.03)
    assert got[128]["t0"] == 109.0 and got[128]["t1"] == 120.0
    assert got[224]["e2e_img_s"] == 400.0 and got[224]["windows"] == 1
    assert got[288]["e2e_img_s"] is None


def test_a_phase_short_of_the_goal_is_blamed_on_what_starved_it():
    assert starved_by(GOAL, 0.5, 50.0, False) is None
    assert starved_by(0.6, 0.35, 60.0, False).startswith("data:")
    assert "JPEG decode" in starved_by(0.6, 0.35, 60.0, False)
    assert "window copies" in starved_by(0.6, 0.35, 60.0, True)
    assert starved_by(0.8, 0.01, 95.0, True).startswith("not the data")
    assert "too short" in starved_by(None, None, None, True)


def test_run_args_train_every_phase_for_one_epoch_on_the_gpu_stack(tmp_path):
    args = run_args(tmp_path / "src", tmp_path, [(128, 256, 0.35), (224, 192, 0.1), (288, 128, 0.5)], 2, False, 224)
    joined = " ".join(args)
    assert "app/run.py" in joined and "--gpu true" in joined and "--workers 2" in joined
    assert "batch_size: 512" in joined and "until_epoch: 3, resolution: 288" in joined
    assert "--schedule.epochs=3" in args and "--config imagenet-rn50-dawnbench" in joined
    assert not any(a.startswith("--model.") for a in args)  # the recipe's bf16 + channels_last + compile
