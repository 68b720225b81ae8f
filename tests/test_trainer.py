"""Trainer state round trip on CPU in one process (a real one-rank gloo group, no Ray Train).

Steps are driven through ``Trainer.train_step`` with synthetic batches; checkpoints go through the real
state files (``save_rank_state`` / ``load_rank_state``) and the recorded resume point (``resume.json``).
"""

import hashlib
import io
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lightray.comm.topology import Topology
from lightray.config import load_config
from lightray.data.ingest import IngestSpec, TierShards
from lightray.storage import write_bytes
from lightray.train.context import LocalContext
from lightray.train.state import (
    CHECKPOINT_FORMAT,
    CheckpointFormatError,
    ResumePoint,
    checkpoint_name,
    choose_and_record_resume,
    load_rank_state,
    save_rank_state,
)
from lightray.train.trainer import PhaseRun, Trainer
from tests.devices import lazy_device

LEGACY_COUNTER_KEYS = ["samples_seen", "step", "starts", "device_seconds", "train_seconds", "resizes",
                       "preemption_checkpoints", "world_size", "best_top1"]
RANK0_KEYS = {"comm", "rng", "model", "optimizer", "scaler", "ema", "lookahead", "counters", "config"}


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory):
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make_trainer(run_dir, records: list | None = None, **overrides) -> Trainer:
    cfg = load_config("smoke", {"optim.ema_decay": 0.9, **overrides})
    empty = TierShards(32, "raw", [], [], [])
    spec = IngestSpec(seed=cfg.scaling.seed, local_dir=str(run_dir), train_size=256, phases=[], val=empty,
                      eval_resolution=48, val_crop_ratio=cfg.data.val_crop_ratio)
    return Trainer(cfg, spec, str(run_dir), 10, rank=0, world=1, topology=Topology(1, 0, 0, 1, 0, 1),
                   report=(records if records is not None else []).append)


def batch(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"image": rng.integers(0, 256, (64, 32, 32, 3), dtype=np.uint8),
            "label": rng.integers(0, 10, 64).astype(np.int64)}


def train(trainer: Trainer, seeds) -> None:
    run = PhaseRun(0, trainer.cfg.schedule.phases[0], 1.0)
    for s in seeds:
        trainer.train_step(batch(s), run)


def write_checkpoint(trainer: Trainer, run_dir, world_size: int) -> str:
    """Rank 0's state file in the run folder, recorded as the resume point of the next start."""
    folder = os.path.join(run_dir, checkpoint_name(trainer.counters.samples_seen))
    save_rank_state(folder, 0, trainer.state_dict(), {"samples_seen": trainer.counters.samples_seen,
                                                       "world_size": world_size})
    write_bytes(os.path.join(run_dir, "resume.json"),
                ResumePoint(folder, trainer.counters.samples_seen, world_size, []).to_json())
    return folder


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_rank0_state_dict_holds_the_checkpoint_keys_and_counters(tmp_path):
    trainer = make_trainer(tmp_path)
    train(trainer, [1, 2])
    folder = write_checkpoint(trainer, tmp_path, world_size=1)
    saved = load_rank_state(folder, 0)
    assert set(saved) == RANK0_KEYS
    assert list(saved["counters"]) == LEGACY_COUNTER_KEYS
    assert saved["counters"]["samples_seen"] == 128 and saved["counters"]["step"] == 2
    assert saved["comm"]["world_size"] == 1 and saved["ema"]["num_updates"] == 2


def test_load_state_dict_continues_exactly(tmp_path):
    a = make_trainer(tmp_path)
    train(a, [1, 2])
    folder = write_checkpoint(a, tmp_path, world_size=1)
    b = make_trainer(tmp_path)
    assert not torch.equal(next(iter(a.model.parameters())), next(iter(b.model.parameters())))
    b.load_state_dict(load_rank_state(folder, 0))
    assert_same_tensors(a.model.state_dict(), b.model.state_dict())
    assert_same_tensors(a.ema.module.state_dict(), b.ema.module.state_dict())
    assert b.counters == a.counters and b.comm.step == a.comm.step
    train(a, [3])
    train(b, [3])  # same batch from the same state: the same next step
    assert_same_tensors(a.model.state_dict(), b.model.state_dict())


AIRBENCH = {"model.arch": "cifar_vgg", "model.widths": [8, 16, 16], "model.zero_init_residual": False,
            "model.whiten_stem": True, "data.translate": 2, "optim.lookahead_every": 2, "optim.bn_lr_factor": 64.0,
            "optim.bn_bias_decay": True, "schedule.tta_translate": 1}


def airbench_batch(seed: int, step: int) -> dict:
    return {**batch(seed), "sample_id": np.arange(64 * step, 64 * (step + 1)), "epoch": np.zeros(64, np.int64)}


def test_airbench_units_whiten_at_a_fresh_runs_first_step_and_resume_exactly(tmp_path):
    records: list = []
    a = make_trainer(tmp_path, records, **AIRBENCH)
    stem = a.model.features[0]
    initial = stem.weight.detach().clone()
    run = PhaseRun(0, a.cfg.schedule.phases[0], 1.0)
    for step, s in enumerate([1, 2]):
        a.train_step(airbench_batch(s, step), run)
    whitened = stem.weight.detach().clone()
    assert not torch.equal(whitened, initial) and torch.equal(whitened[12:], -whitened[:12])
    assert torch.equal(a.ema.module.features[0].weight, whitened)  # the average restarted from the whitened stem
    assert [r["unit"] for r in records if r.get("event") == "unit"] == ["whiten_stem"]
    assert {g["name"]: g["lr"] / a.optimizer.param_groups[0]["lr"] for g in a.optimizer.param_groups}["bn"] == 64.0
    folder = write_checkpoint(a, tmp_path, world_size=1)
    b = make_trainer(tmp_path, **AIRBENCH)
    b.load_state_dict(load_rank_state(folder, 0))
    for step, s in enumerate([3, 4], start=2):  # step 4 is a lookahead sync: it reads the restored slow weights
        a.train_step(airbench_batch(s, step), run)
        b.train_step(airbench_batch(s, step), run)
    assert torch.equal(b.model.features[0].weight, whitened)  # frozen, and not whitened again after a resume
    assert_same_tensors(a.model.state_dict(), b.model.state_dict())
    for x, y in zip(a.lookahead.slow, b.lookahead.slow):
        assert torch.equal(x, y)


def test_restore_at_same_world_size_restores_rng_and_counts_a_restart(tmp_path):
    a = make_trainer(tmp_path)
    train(a, [1, 2])
    torch.rand(7)  # a draw moves the stream away from the freshly seeded state
    saved_rng = torch.get_rng_state()
    write_checkpoint(a, tmp_path, world_size=1)
    records: list = []
    b = make_trainer(tmp_path, records)  # seeds the global RNG afresh
    assert not torch.equal(torch.get_rng_state(), saved_rng)
    b.restore()
    assert torch.equal(torch.get_rng_state(), saved_rng)
    assert b.counters.starts == 1 and b.counters.resizes == 0 and b.counters.samples_seen == 128
    assert [r["event"] for r in records] == ["start"]


def test_restore_reads_the_checkpoint_to_the_cpu_whatever_the_workers_device(tmp_path):
    """Every resume on a GPU crashed: the files were loaded onto the worker's device, and the comm hook's
    generator takes only a CPU tensor. The read must not depend on the worker's device: here the trainer's
    device is torch's lazy device (not the CPU, with real data) while the checkpoint is read; each part then
    moves what it needs to the device it lives on (the CPU here), and the run continues exactly."""
    lazy = lazy_device()
    if lazy is None:
        pytest.skip("torch's lazy-tensor backend is not available in this torch build")
    a = make_trainer(tmp_path)
    train(a, [1, 2])
    write_checkpoint(a, tmp_path, world_size=1)
    b = make_trainer(tmp_path)
    b.device = lazy  # the worker's device, as the checkpoint read sees it
    b.restore()
    b.device = torch.device("cpu")
    train(a, [3])
    train(b, [3])
    assert_same_tensors(a.model.state_dict(), b.model.state_dict())
    assert_same_tensors(a.ema.module.state_dict(), b.ema.module.state_dict())


def test_resume_at_the_same_world_size_keeps_the_checkpoints_bucket_size(tmp_path):
    """The bucket size decides which entries top-k selects from together; measured afresh at each start,
    it changed the run after a restart. The checkpoint's meta carries it; a start at the same world size
    uses it (a resize measures again)."""
    a = make_trainer(tmp_path, **{"comm.bucket_mb": "3.5"})  # a size unlike the one-worker default (25 MB)
    a.ctx = LocalContext(str(tmp_path), {}, keep=3)
    train(a, [1, 2])
    a.checkpoint("interval", {})
    point = choose_and_record_resume(str(tmp_path))
    assert json.loads(open(os.path.join(point.checkpoint, "meta_rank0.json")).read())["bucket_mb"] == 3.5
    b = make_trainer(tmp_path)
    assert b.bucket_mb == 3.5 and b.bucket_evidence["saved"], b.bucket_evidence
    assert b.ddp.bucket_bytes_cap == int(3.5 * 1024 * 1024)
    write_bytes(os.path.join(tmp_path, "resume.json"),
                ResumePoint(point.checkpoint, point.samples_seen, 2, []).to_json())  # written by two workers
    assert make_trainer(tmp_path).bucket_mb == 25.0


def test_restore_after_resize_keeps_fresh_rng_and_reports_the_resize(tmp_path):
    a = make_trainer(tmp_path)
    train(a, [1, 2])
    torch.rand(7)  # the saved stream differs from the fresh one, so a wrong restore would show
    write_checkpoint(a, tmp_path, world_size=2)  # as if written by a two-worker group
    records: list = []
    b = make_trainer(tmp_path, records)
    fresh_rng = torch.get_rng_state()
    b.restore()
    assert torch.equal(torch.get_rng_state(), fresh_rng)
    assert_same_tensors(a.model.state_dict(), b.model.state_dict())
    assert b.counters.resizes == 1 and b.counters.world_size == 1
    assert [r["event"] for r in records] == ["resize", "start"]
    assert records[0]["from"] == 2 and records[0]["to"] == 1


def test_checkpoint_files_load_with_weights_only_and_restore_numpy_rng(tmp_path):
    a = make_trainer(tmp_path)
    train(a, [1, 2])
    np.random.seed(5)
    np.random.rand(3)  # a cached position inside NumPy's key array, not a fresh seed
    expected = np.random.rand(4)
    np.random.seed(5)
    np.random.rand(3)
    folder = write_checkpoint(a, tmp_path, world_size=1)
    with open(os.path.join(folder, "state_rank0.pt"), "rb") as f:
        raw = torch.load(f, weights_only=True)  # raises UnpicklingError on anything but tensors and plain values
    assert isinstance(raw["rng"]["numpy"]["keys"], torch.Tensor)
    assert json.loads(open(os.path.join(folder, "meta_rank0.json")).read())["format"] == CHECKPOINT_FORMAT
    np.random.seed(99)
    make_trainer(tmp_path).restore()
    assert np.array_equal(np.random.rand(4), expected)


def write_format1_checkpoint(trainer: Trainer, run_dir) -> str:
    """A checkpoint as the previous version wrote it: NumPy's RNG state pickled, no format in the meta."""
    folder = write_checkpoint(trainer, run_dir, world_size=1)
    state = trainer.state_dict()
    state["rng"]["numpy"] = np.random.get_state()
    buf = io.BytesIO()
    torch.save(state, buf)
    write_bytes(os.path.join(folder, "state_rank0.pt"), buf.getvalue())
    meta = {"samples_seen": trainer.counters.samples_seen, "world_size": 1, "rank": 0,
            "sha256": hashlib.sha256(buf.getvalue()).hexdigest()}
    write_bytes(os.path.join(folder, "meta_rank0.json"), json.dumps(meta).encode())
    return folder


def test_format1_checkpoint_is_refused_by_name_unless_pickle_is_allowed(tmp_path):
    a = make_trainer(tmp_path)
    train(a, [1, 2])
    folder = write_format1_checkpoint(a, tmp_path)
    with pytest.raises(CheckpointFormatError, match=r"checkpoint format 1 .*--checkpoint.allow_pickle=true"):
        load_rank_state(folder, 0)
    with pytest.raises(CheckpointFormatError, match="format 1"):
        make_trainer(tmp_path).restore()
    b = make_trainer(tmp_path)
    b.cfg.checkpoint.allow_pickle = True
    b.restore()  # the trusted old file resumes, NumPy's tuple state included
    assert_same_tensors(a.model.state_dict(), b.model.state_dict())


def test_checkpoint_from_a_newer_format_is_refused(tmp_path):
    a = make_trainer(tmp_path)
    folder = write_checkpoint(a, tmp_path, world_size=1)
    meta_path = os.path.join(folder, "meta_rank0.json")
    meta = json.loads(open(meta_path).read())
    write_bytes(meta_path, json.dumps(dict(meta, format=CHECKPOINT_FORMAT + 1)).encode())
    with pytest.raises(CheckpointFormatError, match="newer lightray"):
        load_rank_state(folder, 0, allow_pickle=True)


def test_resume_of_a_format1_run_exits_2_before_starting_ray(tmp_path):
    run_dir = tmp_path / "old"
    a = make_trainer(run_dir)
    train(a, [1])
    folder = write_format1_checkpoint(a, run_dir)
    before = open(os.path.join(folder, "state_rank0.pt"), "rb").read()
    out = subprocess.run([sys.executable, "app/run.py", "--resume", "--storage", str(tmp_path), "--name", "old",
                          "--scaling.ray_address=local"], capture_output=True, text=True, timeout=120,
                         cwd=pathlib.Path(__file__).parents[1])
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{folder}: checkpoint format 1" in out.stderr and "allow_pickle" in out.stderr
    assert "ray_start" not in out.stdout and not (run_dir / "summary.json").exists()
    assert open(os.path.join(folder, "state_rank0.pt"), "rb").read() == before  # nothing rewritten
