"""Resume as exact continuation after a killed driver: kill, resume, compare with an uninterrupted run (the session's
finished run, tests/finished_run.py, made with the same options). The graceful stop and resume is checked on S3
(tests/test_s3_runs.py), against the same reference."""

import json
import shutil

import pytest

from tests.faults import assert_same_model, checkpoints, driver, final_state, finish, kill_group, records, wait_for
from tests.finished_run import finished_run_args

pytestmark = pytest.mark.slow


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
    # Replaying from the older checkpoint lands on the same model.
    assert_same_model(final_state(run)["model"], final_state(uninterrupted)["model"])
    shutil.rmtree(run / "sample_log", ignore_errors=True)
