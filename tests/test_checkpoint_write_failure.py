"""A checkpoint write that fails part-way (a real write error from the kernel) never counts, and the
checkpoints written before it stay the ones a restart resumes from."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

from lightray.train.state import list_checkpoints, select_resume

ROOT = pathlib.Path(__file__).parents[1]

# Writes one whole checkpoint, then limits the file size (RLIMIT_FSIZE: the kernel ends writes past 256 kB
# with EFBIG, as a full disk ends them with ENOSPC) and writes a bigger one two ways: through our own
# save_rank_state into the run folder, and as Ray Train uploads one (pyarrow copy of a finished temp folder).
SCRIPT = textwrap.dedent("""
    import resource, signal, sys, tempfile
    import pyarrow.fs as pafs
    import torch
    from lightray.storage import join
    from lightray.train.state import checkpoint_name, save_rank_state
    run = sys.argv[1]

    def copy(src, dst):  # what Ray Train's persist_current_checkpoint does
        fs = pafs.LocalFileSystem()
        fs.create_dir(dst)
        pafs.copy_files(src, dst, source_filesystem=fs, destination_filesystem=fs)

    meta = {"world_size": 1, "time": 0.0, "step": 1, "reason": "epoch"}
    save_rank_state(join(run, checkpoint_name(64)), 0, {"w": torch.zeros(10)}, dict(meta, samples_seen=64))
    big = {"w": torch.randn(1 << 18)}  # 1 MB
    with tempfile.TemporaryDirectory() as tmp:
        save_rank_state(tmp, 0, big, dict(meta, samples_seen=192))  # complete, before the limit
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 18, 1 << 18))
        for how, write in (
            ("own", lambda: save_rank_state(join(run, checkpoint_name(128)), 0, big, dict(meta, samples_seen=128))),
            ("copy", lambda: copy(tmp, join(run, checkpoint_name(192)))),
        ):
            try:
                write()
                print(how, "written")
            except OSError as exc:
                print(how, "failed", exc.errno if exc.errno else type(exc).__name__)
""")


def test_a_checkpoint_write_cut_short_is_not_counted_and_the_previous_one_stays(tmp_path):
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(run)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert [ln.split()[:2] for ln in lines] == [["own", "failed"], ["copy", "failed"]], out.stdout
    # Our own write is atomic: the failed state file never appeared, and its meta was never written.
    assert not (run / "checkpoint_000000000128" / "state_rank0.pt").exists()
    # The upload left a truncated folder behind; listing sees it, resume must not take it.
    assert (run / "checkpoint_000000000192").is_dir()
    assert [s for s, _ in list_checkpoints(str(run))] == [192, 128, 64]
    point = select_resume(str(run))
    assert point.samples_seen == 64 and point.checkpoint.endswith("checkpoint_000000000064")
    assert len(point.skipped) == 2, point.skipped
