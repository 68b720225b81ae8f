"""A GPU-shaped run on the CPU: the smoke recipe with bf16 autocast, torch.compile (inductor's C++ backend),
``data.augment_on=device`` and ``data.decode_on=device``, all on the CPU device, and the compile shape policy
it relies on: one compile per phase resolution, whatever the per-rank batch.

Compiles are counted by dynamo's own counters (graphs it captured): nothing is replaced. A first inductor
compile of resnet_tiny on 2 cores takes about a minute; later ones hit inductor's on-disk cache (seconds).

On the CPU backend one compile covers a range of batch sizes, not all of them: inductor's C++ reductions guard
on whether a BN layer's batch x height x width exceeds 4096 (``need_use_acc_helper``), so the sizes each test
mixes stay on one side of those lines (10 and 11 in the run; 17, 31 and 32 at 32 px, then 15 and 16 at
48 px in the trainer test).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightray.config import load_config
from lightray.train import device as dev
from tests.test_step_sync import batches, make_trainer, one_rank_group  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.shares_cpu]  # a compiled run and two compiles: about 2 minutes on 2 cores

COMPILE_ON_CPU = {"model.precision": "bf16", "model.compile": True, "model.compile_on_cpu": True}


def _fresh_dynamo() -> None:
    """Forget what this process compiled before: a graph another test compiled at the same resolution would
    be reused (0 compiles) and its batch-size guards would count against this test's sizes."""
    import torch._dynamo

    torch._dynamo.reset()


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_smoke_run_bf16_compiled_with_device_augment_and_decode_on_cpu(tmp_path, ray_local, smoke_overrides):
    from lightray.driver.runner import run_training

    over = {**smoke_overrides, **COMPILE_ON_CPU, "storage": str(tmp_path), "name": "gpushaped",
            "scaling.workers": "1", "report.eval_sweep": [], "report.tensorboard": False,
            "data.augment_on": "device", "data.decode_on": "device",
            # 32 px stored raw (the device crops it), 48 px as JPEG read from disk (the device decodes it)
            "data.raw_max_resolution": 32, "data.memory_budget_mb": 0,
            # micro-steps of uneven size: each share of 64 runs as 10+10+11+11+11+11, of 32 as 10+11+11
            "scaling.max_batch_per_device": "12"}
    _fresh_dynamo()
    # One worker in this process (app/train/inline.py): the trainer, streams and checkpoints of a Ray Train run
    summary = run_training(load_config("smoke", over), progress=False, inline=True)
    assert summary["status"] == "finished" and summary["epochs"] == 2
    lines = _records(tmp_path / "gpushaped")
    units = [r for r in lines if r.get("event") == "unit"]
    said = {u["unit"]: u for u in units if "phase" not in u}
    assert said["precision"]["precision"] == "bf16"
    assert said["compile"]["enabled"] and said["compile"]["device"] == "cpu"
    placed = {(u["unit"], u["phase"]): u["on"] for u in units
              if u["unit"] in ("augment_on", "decode_on") and "phase" in u}  # the planner's per-phase lines
    assert placed[("augment_on", 0)] == "device" and placed[("decode_on", 1)] == "device", placed
    train = [r for r in lines if "event" not in r and "val_top1" not in r]
    assert {r["resolution"] for r in train} == {32, 48} and all(np.isfinite(r["loss"]) for r in train)

    compiles = [u for u in units if u["unit"] == "compile" and "phase" in u]
    assert [(c["phase"], c["resolution"]) for c in compiles] == [(0, 32), (1, 48)]
    assert compiles[0]["batch_sizes"] == [10, 11] and compiles[1]["batch_sizes"] == [10, 11]
    # One compile at the first resolution for both micro-batch sizes, exactly one more at the second; a graph
    # break inside the model would show here as more than one graph.
    assert [c["compiles"] for c in compiles] == [1, 1], compiles
    assert all("graph_breaks" in c for c in compiles)


def test_trainer_compiles_once_per_resolution_whatever_the_batch(tmp_path, one_rank_group):  # noqa: F811
    # One thread, as the inline run above trains with (a worker of 0.5 CPUs): inductor's C++ kernels depend on
    # the thread count, and with the run's count the compiles here can reuse what inductor cached for it.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        at_32, at_48, trainer = _steps_at_two_resolutions(tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert (at_32, at_48) == (1, 1), f"compiles at 32 px: {at_32}, at 48 px: {at_48}"
    assert trainer.forward.pop_batch_sizes() == [15, 16, 17, 31, 32]
    assert torch.isfinite(trainer.window["loss"]).all()


def _steps_at_two_resolutions(tmp_path) -> tuple[int, int, object]:
    """Train steps of uneven batches at 32 px, then at 48 px; the graphs dynamo compiled at each."""
    _fresh_dynamo()
    trainer, _ = make_trainer(tmp_path, **COMPILE_ON_CPU)
    assert isinstance(trainer.forward, dev.CompiledForward)
    first, second = trainer.phase_run(0), trainer.phase_run(1)
    start = _graphs()
    for size in (32, 31, 17):  # a full share, one short of an image the decode dropped, an uneven resize
        trainer.train_step(next(batches(1, size=size, res=32, seed=size)), first)
    at_32 = _graphs() - start
    trainer.counters.samples_seen = trainer.sched.epoch_start(1)  # where the 48 px phase begins
    for size in (16, 15):
        trainer.train_step(next(batches(1, size=size, res=48, seed=size)), second)
    return at_32, _graphs() - start - at_32, trainer


# --- global BN under torch.compile: a real 2-rank gloo group ----------------------------------------------------
class _GlobalBNNet(torch.nn.Module):
    """Two conv + global BN blocks and a head: enough for BN-below-BN gradients, small enough to trace fast. Its
    own class, as a model is: dynamo does not start a frame in torch's own modules (an ``nn.Sequential`` root
    under DDP would be compiled layer by layer)."""

    def __init__(self) -> None:
        from torch import nn

        from lightray.comm.global_bn import GlobalBatchNorm2d

        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3), GlobalBatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3), GlobalBatchNorm2d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


def _global_bn_worker(rank: int, folder: str) -> None:
    """A compiled and an eager copy of a global-BN net under DDP, the same weights and batches (a different share
    per rank and per step); saves the gradients of both and the compile counts."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    torch.manual_seed(0)
    eager = _GlobalBNNet()
    twin = copy.deepcopy(eager)
    # The min-cut partitioner is inductor's; without inductor's C++ codegen the compile takes seconds.
    compiled = dev.CompiledForward(torch.compile(DDP(twin), backend="aot_eager_decomp_partition"))
    eager_ddp = DDP(eager)
    start, out = _graphs(), {"grads": []}
    for step, size in enumerate((6 + rank, 3 + rank, 5)):
        g = torch.Generator().manual_seed(100 * step + rank)
        # A mean far from 0: the shift of the sums matters, as it does after a few steps of real training.
        x, y = torch.rand(size, 3, 16, 16, generator=g) * 2 + 3, torch.randint(0, 5, (size,), generator=g)
        for model, fwd in ((eager, eager_ddp), (twin, compiled)):
            model.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(fwd(x.clone()), y).backward()
        out["grads"].append({n: (p.grad, q.grad) for (n, p), q in zip(eager.named_parameters(), twin.parameters())})
    out["compiles"] = _graphs() - start
    out["running"] = [(a, b) for a, b in zip(eager.buffers(), twin.buffers()) if a.is_floating_point()]
    torch.save(out, os.path.join(folder, f"rank{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown: slow on a loaded machine


def test_global_bn_compiles_as_one_graph_with_the_eager_gradients(tmp_path):
    mp.spawn(_global_bn_worker, args=(str(tmp_path),), nprocs=2, join=True)
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        # No graph break at the BN layers' collectives, no recompile for a new batch size.
        assert out["compiles"] == 1
        for step in out["grads"]:
            for name, (a, b) in step.items():
                err = float((a - b).abs().max() / a.abs().max().clamp_min(1e-12))
                assert err < 1e-3, f"rank {rank} {name}: compiled gradient off by {err:.2e} (relative)"
        for a, b in out["running"]:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
