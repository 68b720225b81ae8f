"""Global BatchNorm: the same recipe takes the same steps on 1, 2 or 3 workers, and across an elastic resize.

Real gloo process groups, real DDP, the real resnet_tiny, optimiser, loss and the trainer's per-rank loss
weighting; each rank trains on its ``rank_slice`` of the same global batches. Plain BatchNorm is run the
same way to show the comparison can fail.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightray.comm.global_bn import GlobalBatchNorm2d, convert_to_global_bn
from lightray.config import ModelConfig, OptimConfig
from lightray.data.plan import rank_slice
from lightray.train.model import build_model
from lightray.train.optim import build_loss, build_optimizer, set_lr_momentum
from lightray.train.trainer import loss_scale

BATCH, CLASSES, RES, STEPS = 10, 5, 16, 4  # a batch of 10 splits unevenly over 3 workers (4/3/3)
TOL = 1e-4


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    # A mean far from 0 exercises the shifted sums in the variance.
    return torch.rand(BATCH, 3, RES, RES, generator=g) * 2 + 1, torch.randint(0, CLASSES, (BATCH,), generator=g)


def _steps(rank: int, world: int, global_bn: bool, first: int, last: int, state_in: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = build_model(ModelConfig(arch="resnet_tiny", global_bn=global_bn, channels_last=False), CLASSES)
    ocfg = OptimConfig(fused=False)
    opt = build_optimizer(model, ocfg, torch.device("cpu"))
    if state_in:
        saved = torch.load(state_in, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    ddp = DDP(model)
    loss_fn = build_loss(ocfg)
    lo, hi = rank_slice(BATCH, world, rank)
    model.train()
    for step in range(first, last):
        set_lr_momentum(opt, 0.2, 0.9)
        x, y = _global_batch(step)
        loss = loss_fn(ddp(x[lo:hi]), y[lo:hi]) * loss_scale(BATCH, world, rank)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _worker(rank: int, world: int, folder: str) -> None:
    """Every scenario of one worker count in one process group (a spawn costs seconds of imports)."""
    dist.init_process_group("gloo", init_method=f"file://{folder}/store{world}", rank=rank, world_size=world)
    out = {"global": _steps(rank, world, True, 0, STEPS, ""), "plain": _steps(rank, world, False, 0, STEPS, "")}
    if world == 2:  # the first half of the elastic run: saved like a checkpoint, resumed on 1 worker
        out["half"] = _steps(rank, world, True, 0, STEPS // 2, "")
    if world == 1:
        out["resized"] = _steps(rank, world, True, STEPS // 2, STEPS, os.path.join(folder, "half.pt"))
    torch.save(out, os.path.join(folder, f"w{world}_rank{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown: slow on a loaded machine


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, list[dict]]:
    root = tmp_path_factory.mktemp("gbn")
    out = {}
    for world in (2, 1, 3):  # 2 first: its half-way state is what the 1-worker resume starts from
        mp.spawn(_worker, args=(world, str(root)), nprocs=world, join=True)
        out[world] = [torch.load(root / f"w{world}_rank{r}.pt", weights_only=False) for r in range(world)]
        if world == 2:
            torch.save(out[2][0]["half"], root / "half.pt")
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_global_bn_parameters_and_running_stats_match_one_worker(runs, world):
    one = runs[1][0]["global"]["model"]
    many = [r["global"] for r in runs[world]]
    diff = _max_diff(one, many[0]["model"])
    assert diff < TOL, f"{world} workers drift from 1 worker by {diff}"
    for r in range(1, world):  # every rank holds the same weights and the same running statistics
        assert _max_diff(many[0]["model"], many[r]["model"]) == 0.0


def test_per_worker_bn_takes_different_steps_on_two_workers(runs):
    # Why the unit exists: plain BN normalises each worker's share, so 2 workers do not take 1 worker's steps.
    assert _max_diff(runs[1][0]["plain"]["model"], runs[2][0]["plain"]["model"]) > 100 * TOL


def test_elastic_resize_mid_run_keeps_the_one_worker_steps(runs):
    # 2 steps on 2 workers, checkpoint, 2 steps on 1 worker == 4 steps on 1 worker.
    whole, resized = runs[1][0]["global"], runs[1][0]["resized"]
    diff = _max_diff(whole["model"], resized["model"])
    assert diff < TOL, f"resized run drifts from the 1-worker run by {diff}"
    assert _max_diff(whole["optimizer"]["state"][0], resized["optimizer"]["state"][0]) < TOL


def test_convert_keeps_parameters_and_buffers_and_counts_layers():
    torch.manual_seed(0)
    plain = build_model(ModelConfig(arch="resnet_tiny", global_bn=False), CLASSES)
    swapped = build_model(ModelConfig(arch="resnet_tiny", global_bn=True), CLASSES)
    assert _max_diff(plain.state_dict(), swapped.state_dict()) >= 0.0  # same keys
    n_plain = sum(isinstance(m, torch.nn.BatchNorm2d) for m in plain.modules())
    assert sum(isinstance(m, GlobalBatchNorm2d) for m in swapped.modules()) == n_plain == 9
    plain.stem[1].running_mean.fill_(3.0)
    assert convert_to_global_bn(plain) == n_plain
    assert isinstance(plain.stem[1], GlobalBatchNorm2d) and float(plain.stem[1].running_mean[0]) == 3.0


def test_global_bn_without_a_process_group_is_plain_batchnorm():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(4)
    gbn = GlobalBatchNorm2d(4)
    x = torch.randn(6, 4, 5, 5) * 3 + 2
    torch.testing.assert_close(gbn(x), bn(x))
    torch.testing.assert_close(gbn.running_var, bn.running_var)


def test_nccl_groups_get_torchs_syncbatchnorm_and_gloo_the_global_layer():
    from lightray.comm.global_bn import batchnorm_kind, to_global_bn

    assert batchnorm_kind("nccl") == "SyncBatchNorm"
    assert batchnorm_kind("gloo") == batchnorm_kind(None) == "GlobalBatchNorm2d"
    torch.manual_seed(0)
    plain = build_model(ModelConfig(arch="resnet_tiny", global_bn=False, channels_last=False), CLASSES)
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    n_bn = sum(isinstance(m, torch.nn.BatchNorm2d) for m in plain.modules())
    synced, n, kind = to_global_bn(plain, "SyncBatchNorm")
    assert kind == "SyncBatchNorm" and n == n_bn > 0
    assert sum(isinstance(m, torch.nn.SyncBatchNorm) for m in synced.modules()) == n_bn
    assert not any(type(m) is torch.nn.BatchNorm2d for m in synced.modules())
    # The same parameters and buffers under the same names: a checkpoint or an export reads either way.
    after = synced.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    # Without a process group (this test's process), the model's own choice is the gloo layer.
    model, n, kind = to_global_bn(build_model(ModelConfig(arch="resnet_tiny", global_bn=False), CLASSES))
    assert kind == "GlobalBatchNorm2d" and n == n_bn
    assert sum(isinstance(m, GlobalBatchNorm2d) for m in model.modules()) == n_bn
