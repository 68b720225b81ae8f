"""Resume as exact continuation: stop (or kill), resume, compare with an uninterrupted run (the session's
finished run, tests/finished_run.py, made with the same options)."""

import json
import shutil

import pytest
import torch

from tests.faults import checkpoints, driver, final_state, finish, kill_group, records, wait_for
from tests.finished_run import finished_run_args

pytestmark = pytest.mark.slow
STOP = 6  # of 12 smoke steps: mid-way through epoch 1


@pytest.fixture(scope="module")
def uninterrupted(finished_run):
    """The session's finished run: these tests start their drivers with its options."""
    return finished_run


@pytest.fixture
def start(uninterrupted):
    shared = uninterrupted.parent.parent  # the folder the finished run and its photos live in

    def start_driver(storage, name, *args, cache):
        return driver(storage, name, *finished_run_args(shared), *args, cache=cache)

    return start_driver


def assert_same_model(a, b):
    sa, sb = final_state(a)["model"], final_state(b)["model"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.allclose(sa[k].float(), sb[k].float(), rtol=1e-4, atol=1e-5), k


def test_stop_and_resume_gives_the_uninterrupted_parameters(uninterrupted, start, tmp_path, shared_cache):
    finish(start(tmp_path, "split", f"--checkpoint.stop_after_steps={STOP}", cache=shared_cache))
    run = tmp_path / "split"
    assert json.loads((run / "summary.json").read_text())["samples_seen"] == 4 * 64 + 2 * 32
    finish(start(tmp_path, "split", "--resume", cache=shared_cache))
    assert final_state(run)["counters"]["samples_seen"] == final_state(uninterrupted)["counters"]["samples_seen"]
    assert_same_model(run, uninterrupted)
    starts = [r for r in records(run) if r.get("event") in ("start", "restart")]
    assert starts[-1]["samples_seen"] == 4 * 64 + 2 * 32  # the second start picked up at the stop


def _samples(checkpoint) -> int:
    return int(checkpoint.name.split("_")[1])


def test_killed_driver_is_finished_by_resume_past_a_corrupt_newest_checkpoint(uninterrupted, start, tmp_path,
                                                                             shared_cache):
    """A driver killed with the local cluster it started (a lost machine), then the newest checkpoint it left
    corrupted (a torn write): the resume skips that one, names it, replays from the one before and lands on the
    uninterrupted model."""
    proc = start(tmp_path, "killed", "--checkpoint.every_steps=2", "--report.every_steps=1", "--checkpoint.keep=100",
                 cache=shared_cache)
    run = tmp_path / "killed"
    wait_for(lambda: len([c for c in checkpoints(run) if _samples(c) >= 4 * 64]) >= 2, 240,
             "two checkpoints from the end of epoch 0 on", proc)
    kill_group(proc)  # the driver and the local Ray cluster it started go down together
    saved = [c for c in checkpoints(run) if (c / "state_rank1.pt").is_file()]  # a kill can cut one short
    newest, fallback = saved[-1], saved[-2]
    data = bytearray((newest / "state_rank1.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (newest / "state_rank1.pt").write_bytes(bytes(data))
    out = finish(start(tmp_path, "killed", "--resume", cache=shared_cache))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["samples_seen"] == 4 * 64 + 8 * 32, out[-2000:]
    restart = [r for r in records(run) if r.get("event") == "restart"][-1]
    assert restart["samples_seen"] == _samples(fallback) >= 4 * 64  # a checkpoint the killed run wrote
    assert any(newest.name in s for s in restart["skipped_checkpoints"]), restart["skipped_checkpoints"]
    assert_same_model(run, uninterrupted)  # replaying from the older checkpoint lands on the same model
    shutil.rmtree(run / "sample_log", ignore_errors=True)
