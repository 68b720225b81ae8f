"""bench.soak's short form: the deployment users run, in small (an autoscaling cluster from the head alone, storage
on S3, the run submitted with `ray job submit`, `scaling.max_failures=0`), through one fault of each kind: a
machine lost without notice, a spot notice, a hung worker, an S3 outage and a killed driver.

One soak runs for the module, in the background (about 5-8 minutes here); each test follows it to a point and
checks what the soak wrote by then, so that a stuck soak fails within one test's 300 s and names the stage."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass

import pytest

from bench import soak
from bench.common import read_jsonl

ROOT = pathlib.Path(__file__).resolve().parents[1]
INTERVAL = soak.CHECKPOINT_EVERY * soak.BATCH  # samples in one checkpoint interval
WAIT_S = 280  # within the 300 s each test may take


def test_the_plan_splits_machine_losses_over_three_kinds_in_a_seeded_order_with_room_for_each():
    plan = soak.fault_plan(0, 15, 3, 1)
    assert Counter(plan) == {"loss": 5, "notice": 5, "hang": 5, "driver_kill": 3, "s3_outage": 1}
    assert plan == soak.fault_plan(0, 15, 3, 1) and plan != soak.fault_plan(1, 15, 3, 1)
    steps = soak.epochs_for(len(plan)) * (soak.TRAIN_IMAGES // soak.BATCH)
    assert steps >= len(plan) * soak.STEPS_PER_FAULT + 2 * soak.TRAIN_IMAGES // soak.BATCH


@dataclass
class Soak:
    proc: subprocess.Popen
    line: pathlib.Path
    progress: pathlib.Path
    err: pathlib.Path

    def lines(self) -> list[dict]:
        return read_jsonl(str(self.progress)) if self.progress.is_file() else []

    def wait(self, pred, what: str):
        """Until ``pred(progress lines)`` holds; the soak ending first, or WAIT_S passing, fails with its log."""
        end = time.time() + WAIT_S
        while time.time() < end:
            if pred(self.lines()):
                return self.lines()
            if self.proc.poll() is not None:
                break
            time.sleep(1.0)
        raise AssertionError(f"soak: no {what} (exit {self.proc.poll()}):\n{self.err.read_text()[-6000:]}")


@pytest.fixture(scope="module")
def short_soak(tmp_path_factory):
    work = tmp_path_factory.mktemp("soak")
    line, progress, err = work / "line.json", work / "progress.jsonl", work / "err.txt"
    with open(line, "w") as out, open(err, "w") as log:
        # --keep: the run's files, and on a failure the cluster's and the jobs' logs, outlive the soak's cluster
        proc = subprocess.Popen([sys.executable, "-m", "bench.soak", "--short", "--progress", str(progress),
                                 "--keep", str(work / "run")], cwd=ROOT, stdout=out, stderr=log,
                                start_new_session=True)
    try:
        yield Soak(proc, line, progress, err)
    finally:
        if proc.poll() is None:  # SIGTERM: the bench leaves through its finally blocks, which stop the cluster
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)


def _recovered(lines: list[dict], kind: str) -> dict | None:
    return next((r for r in lines if r.get("event") == "recovered" and r["kind"] == kind), None)


@pytest.mark.slow
@pytest.mark.timing_bound
def test_a_run_submitted_to_a_head_without_cpus_trains_on_machines_the_autoscaler_launches(short_soak):
    lines = short_soak.wait(lambda ls: any(r["event"] == "first_step" for r in ls), "first step")
    (first,) = [r for r in lines if r["event"] == "first_step"]
    # Sized at the first worker-group start from the machines then up (the head has none), not at the floor.
    share = first["data_share"][0]
    assert share["cluster_cpus"] >= share["train_cpus"] >= 1.5 and share["sized_from_nodes_then"], share


@pytest.mark.slow
@pytest.mark.timing_bound
def test_machines_lost_with_or_without_notice_or_hung_are_preemptions_losing_at_most_an_interval(short_soak):
    lines = short_soak.wait(lambda ls: all(_recovered(ls, k) for k in soak.MACHINE_KINDS), "machine faults survived")
    loss, notice, hang = (_recovered(lines, k) for k in soak.MACHINE_KINDS)
    # max_failures=0: a machine fault charged to the failure budget would have ended the run instead.
    # Checkpointed at the notice, before the machine went at its deadline.
    assert notice["lost_samples"] == 0 and notice["checkpointed_before_deadline"], notice
    assert loss["lost_samples"] <= INTERVAL and hang["lost_samples"] <= INTERVAL, (loss, hang)
    assert hang["hung_process_ended"], hang  # not left stopped, holding its machine
    # Back within the collective timeout its peers waited plus a worker-group restart on a machine the autoscaler
    # brings, not torch's 30-minute default (the full soak of 2026-12-05: five hangs back in 55-94 s). This is the
    # CI check of bench.chaos's peer_hang too (test_chaos_bench, now run by hand): the same SIGSTOP of a Train worker.
    assert hang["restart_s"] is not None and hang["restart_s"] < soak.COLLECTIVE_TIMEOUT_S + 120, hang


def check_short_soak(fig: dict) -> None:
    """What the whole short soak must show (also usable on a line saved from a run by hand)."""
    assert fig["status"] == "finished" and fig["not_injected"] == [], fig["injections"]
    assert fig["max_failures"] == 0 and sorted(fig["plan"]) == sorted(soak.KINDS)
    for kind, row in fig["faults"].items():
        assert row["injected"] == row["survived"] == 1, (kind, fig["injections"])
    assert fig["job_api_without_token"] in (401, 403)  # token auth on, as cluster.yaml sets it
    assert fig["jobs"] == 2  # the killed driver's run submitted again with --resume
    (outage,) = [d for d in fig["injections"] if d["kind"] == "s3_outage"]
    assert outage["turned_away"] >= 1, outage  # the outage met the run's requests
    (kill,) = [d for d in fig["injections"] if d["kind"] == "driver_kill"]
    assert kill["killed_groups"] >= 1 and kill["lost_samples"] <= INTERVAL, kill
    assert fig["audit_exact"], fig["audit_diff"]  # every planned sample carried once by the final model
    # Ray Data's share sized at every worker-group start from the machines then up.
    assert fig["every_share_sized_from_nodes_then"], fig["data_share_per_start"]
    assert len(fig["data_share_per_start"]) >= fig["worker_group_starts"] >= 4
    # Billed through every loss, the worker machines by their price labels; the head (driver) at the default.
    cost = fig["cost"]
    assert cost["usd"] > 0 and "g5.48xlarge-spot" in cost["prices"], cost
    assert set(cost["prices"]) <= {"g5.48xlarge-spot", "g5.48xlarge", "local"}, cost


@pytest.mark.slow
@pytest.mark.timing_bound
def test_an_s3_outage_and_a_killed_driver_are_ridden_out_and_every_sample_is_carried_once(short_soak):
    try:
        short_soak.proc.wait(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"soak still running after {WAIT_S} s more:\n{short_soak.err.read_text()[-6000:]}") \
            from None
    lines = [ln for ln in short_soak.line.read_text().splitlines() if ln.strip()]
    assert len(lines) == 1, short_soak.err.read_text()[-6000:]
    check_short_soak(json.loads(lines[0])["figures"])
    assert short_soak.proc.returncode == 0
    # Stopped by pid: nothing of the soak's cluster is left running.
    temp_dir = json.loads(lines[0])["figures"]["cluster_temp_dir"]
    fake_cluster = soak.fake_cluster_module()
    assert not [cmd for _, cmd in fake_cluster.process_table().values() if temp_dir in cmd]
