"""Gradient accumulation (``scaling.max_batch_per_device``): one worker in 4 micro-steps takes the steps of 4 workers.

The headline test runs the real ``Trainer`` loop (``Trainer.run``: the phase's micro-step plan, the device
prefetcher, DDP with ``no_sync``, the optimizer, validation and the epoch's checkpoint) on real gloo groups:
4 ranks in 4 spawned processes, each taking its ``rank_slice`` (4 images) of every global batch of 16, and one
worker in this process taking all 16 in micro-batches of at most 4. Plain BatchNorm normalises each micro-batch
by itself, as each of the 4 workers normalises its 4 images, so the two take the same steps; the same worker
without a cap (BatchNorm over 16) is run too, to show the comparison can fail. A second test runs 2 ranks in 2
micro-steps of 4 each: their all-reduce after a ``no_sync`` micro-step, and their agreement on one cap.

The worker's context is this file's: streams of synthetic uint8 batches (each rank its slice of the global
batch of every step, as Ray Data gives it), checkpoint folders gathered in the run folder."""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import pathlib
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lightray.config import ConfigError, load_config
from lightray.data.plan import rank_slice
from lightray.train import accumulate
from lightray.train.accumulate import MicroPlan, micro_slices, micro_steps_for, plan_phase
from tests.worker_context import FolderContext

GLOBAL_BATCH, RES, TRAIN_SIZE, CLASSES = 16, 16, 64, 10  # 4 steps of 16 in the one epoch
TOL = 1e-4
PHASES = f"[{{until: 1.0, resolution: {RES}, batch_size: {GLOBAL_BATCH}}}]"
OVERRIDES = {"schedule.epochs": 1, "schedule.phases": PHASES,
             "schedule.eval_resolution": RES, "report.every_steps": 2, "report.eval_sweep": "[]",
             "checkpoint.every_steps": 0, "optim.ema_decay": 0.0, "comm.bucket_mb": 25,
             "model.precision": "fp32"}  # exact sums: bf16 autocast (auto on a CPU with bf16) rounds each pass


def global_batch(epoch: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([epoch, step, 7])
    return (rng.integers(0, 256, (GLOBAL_BATCH, RES, RES, 3), dtype=np.uint8),
            rng.integers(0, CLASSES, GLOBAL_BATCH).astype(np.int64))


class Stream:
    def __init__(self, ctx: Context, name: str):
        self.ctx, self.name = ctx, name

    def iter_batches(self, batch_size=None, **_):
        lo, hi = rank_slice(GLOBAL_BATCH, self.ctx.world, self.ctx.rank)
        if self.name == "val":
            images, labels = global_batch(99, 0)
            yield {"image": images[lo:hi], "label": labels[lo:hi]}
            return
        trainer = self.ctx.trainer
        for epoch in range(trainer.sched.epochs):
            for step in range(trainer.sched.steps_in_epoch(epoch)):
                images, labels = global_batch(epoch, step)
                yield {"image": images[lo:hi], "label": labels[lo:hi], "sample_id": np.arange(lo, hi),
                       "epoch": np.full(hi - lo, epoch)}


class Context(FolderContext):
    """What Ray Train gives a worker, for one rank of a gloo group."""

    def dataset_shard(self, name: str) -> Stream:
        return Stream(self, name)


def train_run(rank: int, world: int, run_dir: str, overrides: dict) -> tuple[dict, list[dict]]:
    """``Trainer.run`` of one rank in the current process group: its parameters at the end and its records."""
    from lightray.data.spec import IngestSpec, PhaseSpec, TierShards
    from lightray.schedule import Schedule
    from lightray.train.trainer import Trainer

    cfg = load_config("smoke", {**OVERRIDES, **overrides})
    sched = Schedule(cfg.schedule, cfg.optim, TRAIN_SIZE)
    empty = TierShards(32, "raw", [], [], [])
    phases = [PhaseSpec(i, p.resolution, p.batch_size, p.min_scale, p.first_epoch, p.end_epoch, empty)
              for i, p in enumerate(sched.resolved.phases)]
    spec = IngestSpec(seed=cfg.scaling.seed, local_dir=run_dir, train_size=TRAIN_SIZE, phases=phases, val=empty,
                      eval_resolution=RES, val_crop_ratio=cfg.data.val_crop_ratio)
    os.makedirs(run_dir, exist_ok=True)
    pathlib.Path(run_dir, "classes.json").write_text(json.dumps([f"c{i}" for i in range(CLASSES)]))  # for the export
    ctx = Context(rank, world, run_dir)
    trainer = Trainer(cfg, spec, run_dir, CLASSES, rank=rank, world=world, ctx=ctx, report=ctx.log)
    ctx.trainer = trainer
    trainer.run()
    params = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    return params, ctx.records


def rank_main(rank: int, world: int, store: str, run_dir: str, out: str, overrides: dict) -> None:
    torch.set_num_threads(1)  # several ranks on a small machine
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        params, records = train_run(rank, world, run_dir, overrides)
        torch.save({"params": params, "records": records}, os.path.join(out, f"w{world}_rank{rank}.pt"))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the parent reads it
        pathlib.Path(out, f"w{world}_rank{rank}.error").write_text(traceback.format_exc()[-3000:])
    os._exit(0)  # skip interpreter teardown: slow on a loaded machine


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].detach().double() - b[k].detach().double()).abs().max()) for k in a)


def train_lines(records: list[dict]) -> list[dict]:
    """The metrics lines of the report steps (not events, not the epoch's validation line)."""
    return [r for r in records if "loss" in r and "event" not in r and "val_top1" not in r]


def units(records: list[dict], unit: str) -> list[dict]:
    return [r for r in records if r.get("event") == "unit" and r.get("unit") == unit]


def spawn_group(tmp_path: pathlib.Path, world: int, by_rank: dict[int, dict]) -> list:
    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=rank_main, args=(r, world, str(tmp_path / f"store{world}"),
                                                   str(tmp_path / f"w{world}"), str(tmp_path), by_rank.get(r, {})))
             for r in range(world)]
    for p in procs:
        p.start()
    return procs


def collect(tmp_path: pathlib.Path, world: int, procs: list) -> list[dict]:
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
    errors = [e.read_text() for e in tmp_path.glob(f"w{world}_rank*.error")]
    assert not errors, errors[0]
    return [torch.load(tmp_path / f"w{world}_rank{r}.pt", weights_only=False) for r in range(world)]


def one_worker_runs(tmp_path: pathlib.Path, runs: dict[str, dict]) -> dict[str, tuple[dict, list[dict]]]:
    """One-worker ``Trainer.run``s in this process, in a one-rank group of their own."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store1'}", rank=0, world_size=1)
    try:
        return {name: train_run(0, 1, str(tmp_path / name), overrides) for name, overrides in runs.items()}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # spawns a trainer per rank
@pytest.mark.shares_cpu
@pytest.mark.timeout(300)
def test_one_worker_in_4_micro_steps_takes_the_steps_of_4_workers(tmp_path):
    procs = spawn_group(tmp_path, 4, {})
    # Meanwhile, in this process: accumulation 4, the whole 16 in one pass, and that without the prefetcher.
    one = one_worker_runs(tmp_path, {"accum": {"scaling.max_batch_per_device": 4}, "whole": {},
                                     "plain": {"scaling.device_prefetch": False}})
    ranks = collect(tmp_path, 4, procs)
    (accum, accum_records), (whole, whole_records), (plain, _) = one["accum"], one["whole"], one["plain"]

    four = ranks[0]["params"]
    assert max_diff(ranks[3]["params"], four) == 0.0  # DDP kept the 4 ranks' weights identical
    assert max_diff(accum, four) < TOL, max_diff(accum, four)
    # The check can fail: one worker taking all 16 in one pass (BatchNorm over 16) takes other steps.
    assert max_diff(whole, four) > 10 * TOL, max_diff(whole, four)
    assert max_diff(plain, whole) == 0.0  # the prefetcher changes when batches arrive, not what is learnt

    [unit] = units(accum_records, "accumulation")
    assert unit["message"].startswith("phase 0: global batch 16 = 1 worker x 4 micro-steps x 4;"), unit
    assert unit["micro_steps"] == 4 and unit["max_batch_per_device"] == 4 and "set by hand" in unit["how"]
    [unit4] = units(ranks[0]["records"], "accumulation")
    assert unit4["message"].startswith("phase 0: global batch 16 = 4 workers x 1 micro-step x 4; no accumulation")
    [no_cap] = units(whole_records, "accumulation")
    assert no_cap["micro_steps"] == 1 and "auto: no cap on cpu" in no_cap["how"]
    # Samples seen and the LR stay those of the global batch: the same metrics lines, step for step.
    lines, lines4 = train_lines(accum_records), train_lines(ranks[0]["records"])
    assert [(r["step"], r["samples_seen"], r["lr"]) for r in lines] == \
           [(r["step"], r["samples_seen"], r["lr"]) for r in lines4]
    assert [(r["step"], r["samples_seen"]) for r in lines] == [(2, 32), (4, 64)]
    # Each rank reports its own slice's mean loss; the one worker's is the mean over all 16, i.e. the ranks' mean.
    mean4 = np.mean([[r["loss"] for r in train_lines(rk["records"])] for rk in ranks], axis=0)
    assert np.allclose([r["loss"] for r in lines], mean4, atol=1e-5)


@pytest.mark.slow  # spawns a trainer per rank
@pytest.mark.shares_cpu
@pytest.mark.timeout(300)
def test_two_workers_accumulate_under_no_sync_with_one_agreed_cap(tmp_path):
    """2 ranks x 2 micro-steps x 4: the first micro-step's gradients stay local (no_sync), the second's backward
    all-reduces their sum. The ranks were given different caps (4 and 8); a rank keeping its own would take
    its 8 in one pass (BatchNorm over 8) and the step would differ."""
    procs = spawn_group(tmp_path, 2, {0: {"scaling.max_batch_per_device": 4}, 1: {"scaling.max_batch_per_device": 8}})
    ((accum, _),) = one_worker_runs(tmp_path, {"accum": {"scaling.max_batch_per_device": 4}}).values()
    pair = collect(tmp_path, 2, procs)
    assert max_diff(pair[1]["params"], pair[0]["params"]) == 0.0
    assert max_diff(pair[0]["params"], accum) < TOL, max_diff(pair[0]["params"], accum)
    units2 = [units(rk["records"], "accumulation")[0] for rk in pair]
    assert [(u["micro_steps"], u["max_batch_per_device"]) for u in units2] == [(2, 4), (2, 4)]
    assert units2[0]["message"].startswith("phase 0: global batch 16 = 2 workers x 2 micro-steps x 4;")
    assert "4 agreed: the smallest of any rank" in units2[1]["how"] and "agreed" not in units2[0]["how"]


@pytest.fixture()
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make_trainer(run_dir, **overrides):
    from lightray.comm.topology import Topology
    from lightray.data.spec import IngestSpec, TierShards
    from lightray.train.trainer import Trainer

    cfg = load_config("smoke", {**OVERRIDES, **overrides})
    empty = TierShards(32, "raw", [], [], [])
    spec = IngestSpec(seed=0, local_dir=str(run_dir), train_size=TRAIN_SIZE, phases=[], val=empty,
                      eval_resolution=RES, val_crop_ratio=cfg.data.val_crop_ratio)
    records: list[dict] = []
    return Trainer(cfg, spec, str(run_dir), CLASSES, rank=0, world=1, topology=Topology(1, 0, 0, 1, 0, 1),
                   report=records.append), records


def test_micro_steps_of_uneven_sizes_sum_to_the_whole_batchs_gradient(tmp_path, one_rank_group):
    """With BatchNorm in eval mode (running statistics: no batch dependence) a slice of 10 in micro-steps of
    3, 3, 2, 2 takes exactly the step of the slice in one pass: the loss weights are each micro-batch's share."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    batch10 = {"schedule.phases": f"[{{until: 1.0, resolution: {RES}, batch_size: 10}}]"}
    whole, _ = make_trainer(tmp_path / "a", **batch10)
    micro, records = make_trainer(tmp_path / "b", **batch10, **{"scaling.max_batch_per_device": 3})
    runs = []
    for t in (whole, micro):
        t.model.eval()
        runs.append(t.phase_run(0))
        seen: list[int] = []
        t.model.register_forward_pre_hook(lambda _m, args, seen=seen: seen.append(args[0].shape[0]))
        for step in range(2):
            images, labels = global_batch(0, step)
            t.train_step({"image": images[:10], "label": labels[:10]}, runs[-1])
        t.seen = seen
    assert whole.seen == [10, 10] and micro.seen == [2, 2, 3, 3] * 2
    assert runs[1].micro_steps == 4 and records[-1]["micro_steps"] == 4
    a = dict(whole.model.named_parameters())
    assert max_diff(a, dict(micro.model.named_parameters())) < 1e-6
    assert abs(float(whole.window["loss"]) - float(micro.window["loss"])) < 1e-5
    assert whole.counters.samples_seen == micro.counters.samples_seen == 20


def test_micro_slices_put_the_larger_parts_last_and_cover_the_share():
    assert micro_slices(16, 4) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert micro_slices(10, 4) == [(0, 2), (2, 4), (4, 7), (7, 10)]
    assert micro_slices(3, 4) == [(0, 0), (0, 1), (1, 2), (2, 3)]  # the empty part first, never the last
    for n in range(0, 40):
        for steps in range(1, 9):
            parts = micro_slices(n, steps)
            assert parts[0][0] == 0 and parts[-1][1] == n and len(parts) == steps
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
            sizes = [hi - lo for lo, hi in parts]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes)


def test_micro_steps_cover_the_largest_share_and_the_unit_line_says_how():
    assert micro_steps_for(8192, 4, 512) == 4 and micro_steps_for(8192, 1, 512) == 16
    assert micro_steps_for(8192, 16, 512) == 1 and micro_steps_for(8192, 4, 0) == 1
    assert micro_steps_for(10, 3, 3) == 2  # shares 4/3/3: the largest needs two micro-steps, so every rank runs two
    plan = plan_phase(0, 8192, 4, 512, "set by hand")
    assert plan.describe().startswith("phase 0: global batch 8192 = 4 workers x 4 micro-steps x 512; gradients")
    assert plan_phase(1, 10, 3, 3, "h").describe().startswith("phase 1: global batch 10 = 3 workers x 2 micro-steps "
                                                              "x up to 2")
    assert MicroPlan(2, 256, 2, 1, 128, 0, "no cap").event()["micro_steps"] == 1
    with pytest.raises(ValueError, match="model.global_bn"):
        plan_phase(0, 10, 3, 1, "h", global_bn=True)  # shares 4/3/3 in 4 micro-steps: a rank would skip one
    assert plan_phase(0, 10, 3, 1, "h", global_bn=False).micro_steps == 4


def test_max_batch_per_device_takes_auto_or_a_count():
    assert load_config("smoke").scaling.max_batch_per_device == "auto"
    assert load_config("smoke", {"scaling.max_batch_per_device": 512}).scaling.max_batch_per_device == "512"
    assert load_config("smoke", {"scaling.max_batch_per_device": "0"}).scaling.max_batch_per_device == "0"
    for bad in ("-1", "lots", "1.5"):
        with pytest.raises(ConfigError, match=r"scaling.max_batch_per_device: bad value .*expected auto or a whole"):
            load_config("smoke", {"scaling.max_batch_per_device": bad})


def test_auto_cap_estimate_follows_resolution_and_leaves_the_model_as_it_was():
    from lightray.config import ModelConfig
    from lightray.train.model import build_model

    cpu = torch.device("cpu")
    model = build_model(ModelConfig(arch="resnet_tiny"), CLASSES).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    small = accumulate.activation_bytes_per_image(model, 32, cpu, "fp32", True)
    large = accumulate.activation_bytes_per_image(model, 64, cpu, "fp32", True)
    assert 3.6 < large / small < 4.4  # activations grow with the pixels
    assert model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # no BN statistics moved
    # 10 GiB free, 2 GiB reserved, 20 MB an image: 0.85 * 8 GiB / 20 MB = 348.1 -> 344, a multiple of 8.
    assert accumulate.cap_from_memory(10 << 30, 20 << 20, 2 << 30) == 344
    assert accumulate.cap_from_memory(1 << 30, 200 << 20, 0) == 4 and accumulate.cap_from_memory(0, 1, 1) == 1
    assert accumulate.resolve_cap("auto", model, 32, cpu, "fp32", True, 64) == (
        0, "scaling.max_batch_per_device=auto: no cap on cpu")
    assert accumulate.resolve_cap("96", model, 32, cpu, "fp32", True, 64)[0] == 96
