"""Resume as exact continuation: stop, resume, compare with an uninterrupted run."""

import json
import shutil
import time

import pytest
import torch

from tests.faults import checkpoints, driver, final_state, finish, kill_group, last_samples, records, wait_for

pytestmark = pytest.mark.slow
STOP = 6  # of 12 smoke steps: mid-way through epoch 1


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, shared_cache):
    storage = tmp_path_factory.mktemp("runs")
    finish(driver(storage, "whole", cache=shared_cache))
    return storage / "whole"


def assert_same_model(a, b):
    sa, sb = final_state(a)["model"], final_state(b)["model"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.allclose(sa[k].float(), sb[k].float(), rtol=1e-4, atol=1e-5), k


def test_stop_and_resume_gives_the_uninterrupted_parameters(uninterrupted, tmp_path, shared_cache):
    finish(driver(tmp_path, "split", f"--checkpoint.stop_after_steps={STOP}", cache=shared_cache))
    run = tmp_path / "split"
    assert json.loads((run / "summary.json").read_text())["samples_seen"] == 4 * 64 + 2 * 32
    finish(driver(tmp_path, "split", "--resume", cache=shared_cache))
    assert final_state(run)["counters"]["samples_seen"] == final_state(uninterrupted)["counters"]["samples_seen"]
    assert_same_model(run, uninterrupted)
    starts = [r for r in records(run) if r.get("event") in ("start", "restart")]
    assert starts[-1]["samples_seen"] == 4 * 64 + 2 * 32  # the second start picked up at the stop


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(uninterrupted, tmp_path, shared_cache):
    finish(driver(tmp_path, "corrupt", f"--checkpoint.stop_after_steps={STOP}", cache=shared_cache))
    run = tmp_path / "corrupt"
    newest = checkpoints(run)[-1]
    data = bytearray((newest / "state_rank1.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (newest / "state_rank1.pt").write_bytes(bytes(data))
    finish(driver(tmp_path, "corrupt", "--resume", cache=shared_cache))
    restart = [r for r in records(run) if r.get("event") in ("start", "restart")][-1]
    assert restart["samples_seen"] == 4 * 64  # the epoch-0 checkpoint, not the corrupt one
    assert restart["skipped_checkpoints"] and newest.name in restart["skipped_checkpoints"][0]
    assert_same_model(run, uninterrupted)  # replaying from the older checkpoint lands on the same model


def test_killed_driver_is_finished_by_resume(uninterrupted, tmp_path, shared_cache):
    proc = driver(tmp_path, "killed", "--checkpoint.every_steps=2", "--report.every_steps=1", cache=shared_cache)
    run = tmp_path / "killed"
    wait_for(lambda: checkpoints(run) and last_samples(run) > 4 * 64, 300, "a checkpoint in epoch 1", proc)
    kill_group(proc)  # the driver and the local Ray cluster it started go down together
    saved = {int(p.name.split("_")[1]) for p in checkpoints(run)}
    time.sleep(1)
    out = finish(driver(tmp_path, "killed", "--resume", cache=shared_cache))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["samples_seen"] == 4 * 64 + 8 * 32, out[-2000:]
    resumed = [r for r in records(run) if r.get("event") == "restart"][-1]["samples_seen"]
    assert resumed in saved and resumed >= 4 * 64  # from a checkpoint the killed run wrote
    assert_same_model(run, uninterrupted)
    shutil.rmtree(run / "sample_log", ignore_errors=True)
