"""One decision for all ranks, on 3 real gloo ranks in 3 processes running the real ``Trainer`` loop: a rank whose
clock runs late (it reached the loop 3 s after the others, as a rank on a slower machine does) and a drain
notice that reaches one rank only. Every checkpoint holds every rank's file at one step, and every rank leaves
for the notice at the same step.

The worker's context is this file's: streams of synthetic uint8 batches (each rank its slice of the global
batch, as Ray Data gives it), checkpoint folders gathered in the run folder as Ray Train gathers them, and a
preemption notice that one rank sees. Nothing in the trainer is replaced."""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import pathlib
import time
import traceback

import numpy as np
import pytest

from tests.worker_context import FolderContext

WORLD = 3
TRAIN_SIZE = 1024


class Stream:
    """``iter_batches`` of one rank's slices: every step of every epoch of one phase, or the validation split."""

    def __init__(self, ctx: Context, name: str):
        self.ctx, self.name = ctx, name

    def iter_batches(self, batch_size=None, **_):
        rng = np.random.default_rng([self.ctx.rank, len(self.name)])
        trainer = self.ctx.trainer
        if self.name == "val":
            n, r = 48 // WORLD, trainer.spec.eval_resolution
            yield {"image": rng.integers(0, 256, (n, r, r, 3), dtype=np.uint8), "label": rng.integers(0, 10, n)}
            return
        ph = trainer.spec.phases[int(self.name.removeprefix("train_p"))]
        for epoch in range(ph.first_epoch, ph.end_epoch):
            for _ in range(trainer.sched.steps_in_epoch(epoch)):
                if self.ctx.step_sleep:
                    time.sleep(self.ctx.step_sleep)
                n = batch_size
                yield {"image": rng.integers(0, 256, (n, ph.resolution, ph.resolution, 3), dtype=np.uint8),
                       "label": rng.integers(0, 10, n), "sample_id": np.arange(n), "epoch": np.full(n, epoch)}


class Context(FolderContext):
    """What Ray Train gives a worker, for one rank of this file's gloo group; ``notice_from_step`` > 0: this
    rank's node is drained from that step on."""

    def __init__(self, rank: int, run_dir: str, late_start_s: float = 0.0, step_sleep: float = 0.0,
                 notice_from_step: int = 0):
        super().__init__(rank, WORLD, run_dir)
        self.late_start_s, self.step_sleep, self.notice_from_step = late_start_s, step_sleep, notice_from_step

    def log(self, record: dict) -> None:
        super().log(record)
        if record.get("event") == "start" and self.late_start_s:
            time.sleep(self.late_start_s)  # this rank reaches the loop late: its clock starts late

    def dataset_shard(self, name: str) -> Stream:
        return Stream(self, name)

    def preemption_info(self):
        step = self.trainer.counters.step
        return f"drain of rank {self.rank}'s node" if self.notice_from_step and step >= self.notice_from_step else None


def rank_main(rank: int, store: str, run_dir: str, overrides: dict, roles: dict, out: str) -> None:
    import torch.distributed as dist

    from lightray.config import load_config
    from lightray.data.ingest import IngestSpec, PhaseSpec, TierShards
    from lightray.schedule import Schedule
    from lightray.train.trainer import PreemptedError, Trainer

    result = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=45))
        cfg = load_config("smoke", overrides)
        sched = Schedule(cfg.schedule, cfg.optim, TRAIN_SIZE)
        empty = TierShards(32, "raw", [], [], [])
        phases = [PhaseSpec(i, p.resolution, p.batch_size, p.min_scale, p.first_epoch, p.end_epoch, empty)
                  for i, p in enumerate(sched.resolved.phases)]
        spec = IngestSpec(seed=cfg.scaling.seed, local_dir=run_dir, train_size=TRAIN_SIZE, phases=phases, val=empty,
                          eval_resolution=cfg.schedule.eval_resolution, val_crop_ratio=cfg.data.val_crop_ratio)
        ctx = Context(rank, run_dir, **roles.get(str(rank), {}))
        trainer = Trainer(cfg, spec, run_dir, 10, rank=rank, world=WORLD, ctx=ctx, report=ctx.log)
        ctx.trainer = trainer
        try:
            trainer.run()
            result["status"] = "finished"
        except PreemptedError:
            result["status"] = "preempted"
        result.update(step=trainer.counters.step, samples_seen=trainer.counters.samples_seen)
    except Exception:  # noqa: BLE001 - the parent reads it
        result.update(status="error", error=traceback.format_exc()[-3000:])
    pathlib.Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def run_group(tmp_path: pathlib.Path, overrides: dict, roles: dict) -> tuple[list[dict], pathlib.Path]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=rank_main, args=(r, str(tmp_path / "store"), str(run_dir), overrides, roles,
                                                   str(tmp_path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) if (tmp_path / f"rank{r}.json").exists()
               else {"rank": r, "status": "no result"} for r in range(WORLD)]
    return results, run_dir


def checkpoint_steps(run_dir: pathlib.Path) -> dict[str, dict[int, int]]:
    """Per checkpoint folder: each rank's recorded step."""
    return {d.name: {int(m.stem.removeprefix("meta_rank")): json.loads(m.read_text())["step"]
                     for m in d.glob("meta_rank*.json")} for d in sorted(run_dir.glob("checkpoint_*"))}


BASE = {"schedule.epochs": 2, "report.every_steps": 2, "checkpoint.every_steps": 0, "optim.ema_decay": 0.0}


@pytest.mark.slow  # about 2 minutes on 2 cores: three ranks train 48 steps of the smoke model with timed checkpoints
@pytest.mark.shares_cpu
def test_timed_checkpoints_are_taken_at_one_step_by_every_rank_when_one_rank_runs_late(tmp_path):
    # Timed checkpoints every 2 s; rank 1 starts its clock 3 s after the others, and every rank's step takes
    # 0.06 s or more: each rank's own clock would cross the threshold at steps tens apart.
    overrides = {**BASE, "checkpoint.every_minutes": 2 / 60}
    roles = {"0": {"step_sleep": 0.06}, "1": {"late_start_s": 3.0, "step_sleep": 0.06}, "2": {"step_sleep": 0.06}}
    results, run_dir = run_group(tmp_path, overrides, roles)
    assert [r["status"] for r in results] == ["finished"] * WORLD, results
    assert len({r["step"] for r in results}) == 1
    ckpts = checkpoint_steps(run_dir)
    reasons = {name: {json.loads(m.read_text())["reason"] for m in (run_dir / name).glob("meta_rank*.json")}
               for name in ckpts}
    assert any("interval" in r for r in reasons.values()), f"no timed checkpoint was taken: {reasons}"
    for name, steps in ckpts.items():
        assert sorted(steps) == list(range(WORLD)) and len(set(steps.values())) == 1, \
            f"{name} holds ranks {steps} (rank: step): not every rank's file at one step"


@pytest.mark.slow  # three ranks train
@pytest.mark.shares_cpu
@pytest.mark.timeout(300)
def test_a_drain_notice_seen_by_one_rank_checkpoints_every_rank_at_one_step(tmp_path):
    roles = {"2": {"notice_from_step": 6}}
    results, run_dir = run_group(tmp_path, dict(BASE), roles)
    assert [r["status"] for r in results] == ["preempted"] * WORLD, results
    assert {r["step"] for r in results} == {6}
    ckpts = checkpoint_steps(run_dir)
    preempted = [name for name in ckpts if any(json.loads(m.read_text())["reason"] == "preemption"
                                               for m in (run_dir / name).glob("meta_rank*.json"))]
    assert len(preempted) == 1 and ckpts[preempted[0]] == dict.fromkeys(range(WORLD), 6), ckpts
