"""bench/gpu_suite.sh, the one-GPU suite, where this machine can check it: the script parses, a step's status
follows from its exit status and log, and its dry run drives every step's real entry point on the CPU to one
summary line per step and the suite's JSON line."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from bench.gpu_e2e import GOAL
from bench.gpu_suite_summary import key_figures, last_json, status
from lightray.train.device import cpu_bf16_flags
from tests.test_pipeline_bench import check_pipeline

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = ("env", "tput128", "tput224", "e2e", "resume", "pipeline", "comm", "sync")  # the order they run in


def test_gpu_suite_script_is_valid_bash():
    out = subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_suite.sh")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_a_step_is_ok_only_with_its_json_line_and_a_cuda_skip_passes_only_in_the_dry_run():
    res = last_json('noise\n{"bench": "x", "figures": {}, "ratios": {}}\n')
    assert res["bench"] == "x"
    assert status("env", 0, res, {}, dry=False) == "ok"
    assert status("env", 0, None, {}, dry=False).startswith("failed")
    assert status("env", 124, None, {}, dry=False) == "timeout"
    assert status("env", 3, res, {}, dry=False) == "failed (3)"
    skipped = key_figures("sync", None, "s\n1 skipped in 2.1s\n")
    assert status("sync", 0, None, skipped, dry=True) == "skipped (no CUDA)"
    assert status("sync", 0, None, skipped, dry=False).startswith("failed")  # on the GPU, a skip is a failure
    assert status("sync", 0, None, key_figures("sync", None, "1 passed in 9s"), dry=False) == "ok"


@pytest.mark.slow
def test_gpu_suite_dry_run_from_the_bundle_alone_names_every_step_and_prints_the_json_line(tmp_path):
    """The rehearsal (bench/gpu_rehearsal.py): the GPU machine's bundle built and sized, and the dry run driven by
    a Python that holds only the GPU machine's packages, with lightray, Ray and pydantic from the bundle alone."""
    out = subprocess.run([sys.executable, "-m", "bench.gpu_rehearsal", "--out-dir", str(tmp_path / "logs")],
                         cwd=ROOT, capture_output=True, text=True, timeout=290)  # within pytest's 300 s
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    rehearsal = json.loads(lines.pop())
    assert rehearsal["fits"] and rehearsal["with_checkout_mib"] <= 60 and rehearsal["suite_rc"] == 0, rehearsal
    assert rehearsal["ray_dropped_mib"] > 30  # ray/jars and the rest a Python-only run never loads
    installed = [ln for ln in out.stderr.splitlines() if ln.startswith("gpu_suite: ray ")]
    assert len(installed) == 1 and "lightray from " in installed[0] and "gpu-rehearsal-" in installed[0], installed
    # One line a step, in the order they run: the headline figures first.
    assert [ln.split(":")[0].removeprefix("step ") for ln in lines if ln.startswith("step ")] == list(STEPS)
    for step in STEPS:
        got = [ln for ln in lines if ln.startswith(f"step {step}: ")]
        assert len(got) == 1, out.stdout
        assert got[0].startswith((f"step {step}: ok", f"step {step}: skipped (no CUDA)")), got[0]
        assert (tmp_path / "logs" / f"{step}.log").is_file()
    res = json.loads(lines[-1])
    assert res["bench"] == "gpu_suite" and set(res["figures"]) == set(STEPS)
    # The comm step sets each mode's compression cost against the training step at lightray's own precision (bf16
    # on a GPU and on a CPU with bf16 in hardware, fp32 on other CPUs), each mode measured on its own: no mode's
    # time copied from another's.
    comm = last_json((tmp_path / "logs" / "comm.log").read_text())["figures"]
    over, per_mode = comm["compress_overhead"], comm["per_mode_s"]
    assert over["step_as"] == ("bf16 autocast" if cpu_bf16_flags() else "fp32") + ", channels_last"
    assert (per_mode["fp16"], per_mode["bf16"]) == (over["cast_fp16_s"], over["cast_bf16_s"])
    assert per_mode["topk"] == over["seconds"]["sampled"]
    hier = over["hierarchical_topk"]
    assert per_mode["hierarchical_topk"] == hier["seconds"] > 0 and hier["node_size"] == 8, hier
    assert res["machine"]["dry_run"] is True
    assert res["figures"]["sync"]["status"] == "skipped (no CUDA)"
    assert res["figures"]["comm"]["figures"]["compression_cost_measured_on"] == "cpu"
    assert res["figures"]["tput224"]["figures"]["plain_bf16_img_s"] > 0
    # The pipeline step is bench.pipeline's one end-to-end run in CI: its whole JSON line is checked here.
    pipeline_log = (tmp_path / "logs" / "pipeline.log").read_text()
    assert sum(ln.startswith('{"bench"') for ln in pipeline_log.splitlines()) == 1, pipeline_log[-3000:]
    check_pipeline(last_json(pipeline_log))
    # The e2e step drove the real app/run.py through its three tiny phases (tests/test_gpu_e2e.py checks
    # the same script's parts; this is its end-to-end dry run).
    e2e = res["figures"]["e2e"]
    assert e2e["status"] == "ok" and set(e2e["figures"]["phases"]) == {"32", "48", "64"}
    for res_px in ("32", "48", "64"):
        ph = e2e["figures"]["phases"][res_px]
        assert ph["e2e_img_s"] > 0 and ph["synthetic_img_s"] > 0
        assert ph["ratio"] == pytest.approx(ph["e2e_img_s"] / ph["synthetic_img_s"], rel=0.01)
        assert 0.0 <= ph["data_wait_frac"] <= 1.0
        assert (ph["starved_by"] is None) == (ph["ratio"] >= GOAL)


def test_a_resumed_run_is_judged_against_the_spread_of_two_uninterrupted_ones():
    import torch

    from bench.gpu_resume import judge

    def model(*offsets: float) -> dict[str, torch.Tensor]:
        base = torch.linspace(-1, 1, 64)
        return {f"w{i}": base + o for i, o in enumerate(offsets)}

    whole = model(0.0, 0.0)
    noisy = model(0.0, 3e-4)  # a second uninterrupted run, bf16 and cudnn.benchmark's last bits apart
    # As far off as the noise: a correct resume, which the old fixed tolerance (rtol 1e-4, atol 1e-5) failed.
    assert judge(whole, noisy, model(0.0, -4e-4))["exact"]
    assert not judge(whole, noisy, model(0.0, 5e-3))["exact"]  # far past the noise: a wrong one
    assert not judge(whole, model(0.0, 0.0), model(0.0, 1e-7))["exact"]  # uninterrupted runs agree bitwise: so must it
    assert judge(whole, model(0.0, 0.0), model(0.0, 0.0))["exact"]
    assert not judge(whole, noisy, {"other": torch.zeros(1)})["exact"]  # another model altogether
