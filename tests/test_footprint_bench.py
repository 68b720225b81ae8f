"""bench.footprint: its one JSON line from real smoke runs, the process kinds it counts, and the start-up
breakdown it reads from a run's startup.json and metrics.jsonl."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from bench.footprint import KINDS, classify
from lightray.startup import breakdown

ROOT = pathlib.Path(__file__).parents[1]


@pytest.mark.bench
@pytest.mark.slow  # two real smoke runs (cold, warm) with their own Ray clusters: minutes on 2 cores
@pytest.mark.timeout(1800)
def test_footprint_bench_smoke_reports_peak_memory_by_kind_and_time_to_first_step():
    proc = subprocess.run([sys.executable, "-m", "bench.footprint", "--smoke-only"], cwd=ROOT, capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    line = json.loads(lines[0])
    assert line["bench"] == "footprint" and {"figures", "ratios", "machine"} <= set(line)
    fig = line["figures"]
    assert fig["size"] == "smoke" and fig["ok"]
    assert fig["peak_pss_mb"] > 100
    assert set(fig["by_kind"]) == set(KINDS)
    # by_kind is the split of the total at its peak: the kinds add up to it.
    assert abs(sum(fig["by_kind"].values()) - fig["peak_pss_mb"]) <= 0.01 * fig["peak_pss_mb"] + 1
    assert fig["by_kind"]["driver"] > 50 and fig["by_kind"]["train_workers"] > 50
    for kind in ("cold", "warm"):
        assert fig["first_step_s"][kind] > 0
        assert fig["ray_worker_processes"][kind] >= 2  # at least the two Train workers
    for run in fig["runs"]:
        phases = run["phases_s"]
        assert {"ray_start", "data_prepare", "worker_group_start", "first_batch"} <= set(phases), phases
        # The phases cover the time to the first step, from the command's start.
        assert abs(sum(phases.values()) - run["first_step_s"]) < 0.5, (phases, run["first_step_s"])
    assert line["ratios"]["peak_goal_over_peak"] > 0
    # The bare Ray Train run with the same workers: measured by the same sampler, below lightray on both counts
    # (lightray runs that and its data pipeline, run log and model on top).
    floor = fig["ray_train_floor"]
    assert floor["rc"] == 0 and floor["by_kind_at_peak"]["train_workers"] > 50
    assert {"imports", "ray_start", "worker_group_start"} <= set(floor["phases_s"])
    assert 0 < floor["first_step_s"] < fig["first_step_s"]["warm"]
    assert 100 < floor["peak_pss_mb"] < fig["peak_pss_mb"]
    assert 0 < line["ratios"]["floor_over_first_step_warm"] < 1 and 0 < line["ratios"]["floor_over_peak_pss"] < 1
    assert line["machine"]["load_avg_1m_at_start"] is not None


def test_processes_are_classified_by_their_ray_title_or_command():
    assert classify(["ray::RayTrainWorker.run_train_fn"], "python") == "train_workers"
    assert classify(["ray::MapBatches(train_unit_batch)"], "python") == "data_workers"
    assert classify(["ray::_calibration_task()"], "python") == "data_workers"
    assert classify(["ray::IDLE"], "python") == "other_ray_workers"
    assert classify(["ray::TrainController.run"], "python") == "other_ray_workers"
    assert classify(["/x/ray/core/src/ray/raylet/raylet", "--raylet_socket_name=s"], "raylet") == "ray_daemons"
    assert classify(["/x/ray/core/src/ray/gcs/gcs_server", "--log_dir=l"], "gcs_server") == "ray_daemons"
    assert classify(["python", "/x/ray/dashboard/dashboard.py", "--host=127.0.0.1"], "python") == "ray_daemons"
    assert classify(["python", "-c", "from multiprocessing.spawn import spawn_main"], "python") == "other"


def test_startup_breakdown_is_contiguous_from_the_command_start_to_the_first_step():
    startup = {"process_start": 100.0, "phases": [
        {"phase": "ray_start", "start": 103.0, "end": 110.0},
        {"phase": "data_prepare", "start": 110.0, "end": 112.0},
        {"phase": "materialisation", "start": 112.5, "end": 113.0},
        {"phase": "calibration", "start": 113.0, "end": 117.0},
        {"phase": "trainer_setup", "start": 117.0, "end": 117.5}]}
    events = [{"event": "start", "time": 130.0}, {"step": 1, "time": 131.0},
              {"event": "first_step", "time": 133.0}]
    out = breakdown(startup, events, origin=99.0)
    assert out["first_step_s"] == 34.0
    assert out["phases_s"] == {"imports": 4.0, "ray_start": 7.0, "data_prepare": 2.0, "materialisation": 0.5,
                               "calibration": 4.0, "trainer_setup": 0.5, "worker_group_start": 12.5,
                               "first_batch": 3.0, "other": 0.5}
    assert abs(sum(out["phases_s"].values()) - out["first_step_s"]) < 1e-6
    # A start event that carries the worker's own set-up time splits it off Ray Train's share; the sum holds.
    split = breakdown(startup, [{"event": "start", "time": 130.0, "setup_s": 2.5}, *events[1:]], origin=99.0)
    assert split["phases_s"]["worker_group_start"] == 10.0 and split["phases_s"]["worker_setup"] == 2.5
    assert split["first_step_s"] == 34.0
    # A run of one worker in the driver (app/train/inline.py) names that phase for what it is.
    inline = breakdown({**startup, "group_phase": "inline_start"}, events, origin=99.0)["phases_s"]
    assert inline["inline_start"] == 12.5 and "worker_group_start" not in inline
    # A run that never reached a step has no first step, and says so.
    assert breakdown(startup, [], origin=99.0)["first_step_s"] is None
