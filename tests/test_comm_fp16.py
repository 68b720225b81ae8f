"""fp16 loss scaling with top-k and error feedback, on a real 2-rank gloo group, on the CPU.

Two things must hold. An overflow on one rank is skipped on every rank and leaves every rank's
residuals and velocities as they were: the compact payload used to clamp an inf to 65,504, so the GradScaler saw a
finite gradient, stepped on it, and ``inf - 65504`` stayed in the residual for ever. And the residuals follow the
loss scale: they are kept unscaled, so a residual written at one scale is delivered right at another.

One process spawn feeds every test (a module fixture): short fp16-autocast DDP trainings with a real
``torch.amp.GradScaler("cpu")`` in which rank 1's gradient gets an inf (or nan) at one step, and the hook on
known tensors across a change of the scale.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch

from lightray.comm.hook import CommHook
from lightray.comm.topology import Topology
from lightray.config import CommConfig
from tests.comm_net import batch, spawn_ranks, three_bucket_model

WORLD = 2
STEPS = 8
BASE = {"ratio": 0.05, "warmup_steps": 2, "payload": "compact"}
# name -> (comm config, workers per simulated node, step whose gradient overflows on rank 1, injected value)
RUNS: dict[str, tuple[dict[str, Any], int, int, float]] = {
    "topk": ({"mode": "topk"}, 2, 3, math.inf),
    "topk_fp32_payload": ({"mode": "topk", "payload": "fp32"}, 2, 3, math.inf),
    "hierarchical_topk": ({"mode": "hierarchical_topk"}, 1, 3, math.inf),  # 2 nodes x 1
    # every DGC unit, sampled selection (fc2's bucket passes MIN_SAMPLED): velocities must roll back too
    "dgc": ({"mode": "topk", "momentum_correction": True, "momentum_masking": True, "local_clip": 5.0,
             "selection": "sampled"}, 2, 3, math.inf),
    # the overflow on a dense warm-up step, where momentum correction keeps the global velocity
    "dgc_dense_step": ({"mode": "topk", "momentum_correction": True, "momentum_masking": True}, 2, 1, math.nan),
}


_model, _batch = three_bucket_model, batch


def _overflow_run(topo: Topology, rank: int, cfg: dict[str, Any], inject_step: int, value: float) -> dict[str, Any]:
    """STEPS fp16 steps as the trainer takes them; rank 1's gradient of fc2.weight gets ``value`` at one entry at
    ``inject_step``. After every step: the parameters, the hook's residuals and velocities, the scale."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.004, gradient_as_bucket_view=True)
    hook = CommHook(CommConfig(**{**BASE, **cfg}), topo, torch.device("cpu"), optimizer="sgd")
    hook.install(ddp)
    scaler = torch.amp.GradScaler("cpu")
    hook.follow_loss_scale(scaler)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=hook.optimizer_momentum(0.9))
    poison = torch.zeros(256, 128)
    poison[7, 5] = value
    after: list[dict[str, Any]] = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        handle = model[2].weight.register_hook(lambda g: g + poison) if step == inject_step and rank == 1 else None
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if handle is not None:
            handle.remove()
        scaler.step(opt)
        scaler.update()
        after.append({"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                      "residuals": hook.residuals(), "velocities": hook.velocities(),
                      "dense_velocities": hook.state_dict()["dense_momentum"], "scale": scaler.get_scale(),
                      "loss": loss.item(), "compressed": hook.compressed_steps})
    return {"after": after, "describe": hook.describe()}


def _scale_change(topo: Topology, rank: int) -> dict[str, Any]:
    """Two top-k steps on known gradients, the loss scale doubled between them (the scaler's growth)."""
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # the scaler makes its scale tensor (2 ** 16) at its first scale()
    hook = CommHook(CommConfig(mode="topk", ratio=0.1, warmup_steps=0, payload="fp32"), topo, torch.device("cpu"))
    hook.follow_loss_scale(scaler)
    s1 = scaler.get_scale()
    out1 = hook.aggregate(_grads(rank, 1) * s1, LAYOUT)
    res1 = hook.residuals()
    scaler.update(2 * s1)
    res1_grown = hook.residuals()
    s2 = scaler.get_scale()
    out2 = hook.aggregate(_grads(rank, 2) * s2, LAYOUT)
    return {"s1": s1, "s2": s2, "out1": out1 / s1, "out2": out2 / s2, "res1": res1, "res1_grown": res1_grown}


N = 40
LAYOUT = [("a", 24), ("b", 16)]


def _grads(rank: int, step: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(1000 * step + rank))


def _worker(rank: int, world: int, folder: str) -> None:
    out: dict[str, Any] = {}
    for name, (cfg, per_node, step, value) in RUNS.items():
        out[name] = _overflow_run(Topology.simulated(world, rank, per_node), rank, cfg, step, value)
    out["scale_change"] = _scale_change(Topology.simulated(world, rank, 2), rank)
    torch.save(out, os.path.join(folder, f"out{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return spawn_ranks(_worker, WORLD, tmp_path_factory.mktemp("comm_fp16"))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", list(RUNS))
def test_an_overflow_on_one_rank_is_skipped_on_every_rank_and_leaves_the_residuals(runs, name):
    _, _, t, _ = RUNS[name]
    for r in range(WORLD):
        before, at = runs[r][name]["after"][t - 1], runs[r][name]["after"][t]
        if t >= BASE["warmup_steps"]:
            assert at["compressed"] == before["compressed"] + 1, "the overflow must hit a compressed step"
        assert at["scale"] == before["scale"] / 2, "the GradScaler must see the overflow and back off"
        assert torch.equal(at["params"], before["params"]), f"rank {r}: the overflowed step was applied"
        assert len(before["residuals"]) > 0 or t < BASE["warmup_steps"]
        assert _same(at["residuals"], before["residuals"]), f"rank {r}: residuals changed by a skipped step"
        for part in ("velocities", "dense_velocities"):
            assert _same(at[part], before[part]), f"rank {r}: {part} changed by a skipped step"
        if "dgc" in name:
            assert len(before["velocities"]) + len(before["dense_velocities"]) > 0


@pytest.mark.parametrize("name", list(RUNS))
def test_training_goes_on_with_finite_values_after_the_overflow(runs, name):
    _, _, t, _ = RUNS[name]
    for r in range(WORLD):
        after = runs[r][name]["after"]
        scales = [2.0 ** 16] + [a["scale"] for a in after]
        assert [s for s in range(STEPS) if scales[s + 1] < scales[s]] == [t], "one skipped step: the injected one"
        for s in range(t + 1, STEPS):
            assert not torch.equal(after[s]["params"], after[s - 1]["params"]), f"rank {r}: step {s} was skipped"
            assert math.isfinite(after[s]["loss"])
            assert bool(torch.isfinite(after[s]["params"]).all())
            for part in ("residuals", "velocities", "dense_velocities"):
                assert all(bool(torch.isfinite(v).all()) for v in after[s][part].values()), (r, s, part)
        last = after[-1]["residuals"]
        assert sum(int(torch.count_nonzero(v)) for v in last.values()) > 0, "error feedback kept nothing"
    torch.testing.assert_close(runs[1][name]["after"][-1]["params"], runs[0][name]["after"][-1]["params"],
                               rtol=0, atol=0)


def _ref_topk(steps: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Top-k with error feedback on the unscaled gradients, written independently of the hook."""
    k = math.ceil(0.1 * N)
    res = [torch.zeros(N) for _ in range(WORLD)]
    outs = []
    for s in steps:
        total = torch.zeros(N)
        for r in range(WORLD):
            acc = _grads(r, s) + res[r]
            idx = acc.abs().topk(k).indices
            total[idx] += acc[idx]
            res[r] = acc.clone()
            res[r][idx] = 0
        outs.append(total / WORLD)
    return outs, res


def test_residuals_are_kept_unscaled_and_delivered_right_after_the_scale_changes(runs):
    outs, _ = _ref_topk([1, 2])
    _, res_after_1 = _ref_topk([1])
    for r in range(WORLD):
        d = runs[r]["scale_change"]
        assert d["s2"] == 2 * d["s1"] == 2 ** 17
        assert torch.equal(d["out1"], outs[0])
        flat = torch.cat([d["res1"][name] for name, _ in LAYOUT])
        assert torch.equal(flat, res_after_1[r]), "the residual is not kept in unscaled units"
        assert _same(d["res1_grown"], d["res1"])  # a growing scale is no skipped step
        # sent at twice the scale it was written at: still the unscaled top-k of residual + gradient
        assert torch.equal(d["out2"], outs[1])


def test_residuals_saved_loss_scaled_by_an_older_version_are_dropped_under_fp16_only():
    topo = Topology.simulated(WORLD, 0, 2)

    def hook(fp16: bool) -> CommHook:
        h = CommHook(CommConfig(mode="topk", ratio=0.1, warmup_steps=0), topo, torch.device("cpu"))
        if fp16:
            h.follow_loss_scale(torch.amp.GradScaler("cpu"))
        return h

    saved = hook(False).state_dict()
    saved["residuals"] = {"a": torch.full((24,), 3.0 * 2 ** 16)}
    assert saved.pop("residual_units") == "unscaled"  # what a state written before this version lacks
    old_fp16 = hook(True)
    old_fp16.load_state_dict(saved, world_size=WORLD)
    assert old_fp16.residuals() == {} and "residuals saved loss-scaled by an older version" in old_fp16.describe()
    old_fp32 = hook(False)  # no loss scale: the residuals were never scaled
    old_fp32.load_state_dict(saved, world_size=WORLD)
    assert torch.equal(old_fp32.residuals()["a"], saved["residuals"]["a"])
    new_fp16 = hook(True)
    new_fp16.load_state_dict({**saved, "residual_units": "unscaled"}, world_size=WORLD)
    assert torch.equal(new_fp16.residuals()["a"], saved["residuals"]["a"])
