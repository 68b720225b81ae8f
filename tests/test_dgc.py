"""Deep Gradient Compression units and sampled top-k selection, on real gloo process groups.

One spawn of 4 processes (2 simulated nodes x 2) feeds every distributed test (module fixture): the
hook on known tensors (clipping, masking, warm-up, checkpoints) and short real DDP trainings (momentum
correction at ratio 1 against torch's momentum SGD). Selection tests run in this process.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from lightray.comm import compress
from lightray.comm.dgc import warmup_ratio
from lightray.comm.hook import CommHook
from lightray.comm.topology import Topology
from lightray.comm.wire import allgather_bytes
from lightray.config import CommConfig
from tests.comm_net import spawn_ranks

WORLD = 4
PER_NODE = 2
N = 40
LAYOUT = [("a", 24), ("b", 16)]
RATIO = 0.1  # k = 4 of 40
MOM = 0.9


def _grads(rank: int, step: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(1000 * step + rank))


def _hook(topo: Topology, nesterov: bool = False, **kw) -> CommHook:
    # fp32 payload: these checks compare exact sums and count 8-byte entries
    cfg = CommConfig(**{"mode": "topk", "warmup_steps": 0, "ratio": RATIO, "payload": "fp32", **kw})
    h = CommHook(cfg, topo, torch.device("cpu"), optimizer="sgd", nesterov=nesterov)
    h.optimizer_momentum(MOM)
    return h


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(WORLD * 16, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(1)
    return x[rank::WORLD], y[rank::WORLD]


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _ddp_run(topo: Topology, x, y, cfg: CommConfig | None, nesterov: bool, steps: int = 6,
             timings: bool = False) -> tuple[torch.Tensor, CommHook | None]:
    """``steps`` SGD steps (momentum 0.9, changing LR); with ``cfg`` through the hook, else DDP's default."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.0005)  # several buckets per step
    hook = None
    if cfg is not None:
        hook = CommHook(cfg, topo, torch.device("cpu"), optimizer="sgd", nesterov=nesterov)
        if timings:
            hook.bucket_timings = []
        hook.install(ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=MOM, nesterov=nesterov)
    for s in range(steps):
        for g in opt.param_groups:
            g["lr"] = 0.1 * (1 + s) / steps  # the LR changes: momentum must stay outside the LR, as in torch
            g["momentum"] = hook.optimizer_momentum(MOM) if hook is not None else MOM
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return _params(model), hook


def _worker(rank: int, world: int, folder: str) -> None:
    topo = Topology.simulated(world, rank, PER_NODE)
    out: dict = {"grads": [_grads(rank, s) for s in range(3)]}

    # Momentum correction, masking, error feedback on known tensors: outputs, velocities, residuals.
    for masking in (False, True):
        h = _hook(topo, momentum_correction=True, momentum_masking=masking)
        outs = [h.aggregate(_grads(rank, s), LAYOUT) for s in range(2)]
        out[("mc", masking)] = {"outs": outs, "vel": torch.cat([h.velocities()[n] for n, _ in LAYOUT]),
                                "res": torch.cat([h.residuals()[n] for n, _ in LAYOUT]),
                                "masked": h.masked_entries, "describe": h.describe()}
        if masking:
            sd = h.state_dict()
            fresh = _hook(topo, momentum_correction=True, momentum_masking=True)
            fresh.load_state_dict(torch.load(_save(sd, folder, rank), weights_only=False), world_size=world)
            out["rt_vel_equal"] = all(torch.equal(fresh.velocities()[k], v) for k, v in h.velocities().items())
            out["rt_vel_keys"] = sorted(fresh.velocities())
            out["rt_continue"] = (h.aggregate(_grads(rank, 2), LAYOUT), fresh.aggregate(_grads(rank, 2), LAYOUT))
            resized = _hook(topo, momentum_correction=True, momentum_masking=True)
            resized.load_state_dict(sd, world_size=world + 4)
            out["resized_vel"] = len(resized.velocities())
            out["resized_describe"] = resized.describe()

    # Per-layer selection: ratio of each parameter of the bucket.
    h = _hook(topo, per_layer=True)
    out["per_layer_out"] = h.aggregate(_grads(rank, 0), LAYOUT)
    out["per_layer_bytes"] = h.bytes_sent

    # Local clipping: a tiny threshold clips every bucket.
    h = _hook(topo, local_clip=0.5)
    out["clip_out"] = h.aggregate(_grads(rank, 0), LAYOUT)
    out["clip_counts"] = (h.clipped, h.clip_checks)

    # Sparsity warm-up: k follows the epochs of samples seen.
    h = _hook(topo, sparsity_warmup_epochs=2.0, sparsity_warmup_start=0.5)
    sent = []
    for epochs in (0.0, 1.0, 2.0, 3.0):
        h.begin_step(epochs)
        before = h.bytes_sent
        h.aggregate(_grads(rank, 0), LAYOUT)
        sent.append(h.bytes_sent - before)
    out["warmup_bytes"] = sent
    out["warmup_describe"] = h.describe()

    # Sampled selection in the hook: a bucket large enough to sample gives the same result as exact.
    big = torch.randn(60_000, generator=torch.Generator().manual_seed(rank)) ** 3
    res = {}
    for sel in ("exact", "sampled"):
        h = _hook(topo, selection=sel, ratio=0.01)
        res[sel] = (h.aggregate(big, [("w", big.numel())]), h.bytes_sent, h.selection.sampled)
    out["selection"] = res

    # Real DDP: momentum correction at ratio 1 is momentum SGD (flat and hierarchical, plain and Nesterov,
    # across the dense warm-up -> compressed switch); at ratio 0.05 it is not.
    x, y = _data(rank)
    for nesterov in (False, True):
        out[("sgd", nesterov)] = _ddp_run(topo, x, y, None, nesterov)[0]
        for mode in ("topk", "hierarchical_topk"):
            cfg = CommConfig(mode=mode, ratio=1.0, warmup_steps=2, momentum_correction=True, payload="fp32")
            params, hook = _ddp_run(topo, x, y, cfg, nesterov, timings=True)
            out[("mc1", mode, nesterov)] = params
            out[("mc1_steps", mode, nesterov)] = (hook.dense_steps, hook.compressed_steps)
            out[("timings", mode, nesterov)] = list(hook.bucket_timings)
    cfg = CommConfig(mode="topk", ratio=0.05, warmup_steps=2, momentum_correction=True, payload="fp32")
    out["mc_sparse"] = _ddp_run(topo, x, y, cfg, False)[0]
    torch.save(out, os.path.join(folder, f"out{rank}.pt"))


def _save(obj: dict, folder: str, rank: int) -> str:
    path = os.path.join(folder, f"ckpt{rank}.pt")
    torch.save(obj, path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return spawn_ranks(_worker, WORLD, tmp_path_factory.mktemp("dgc"))


# --- references (written independently of the hook) ------------------------------------------------
def _ref_mc(runs: list[dict], steps: int, masking: bool) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                                   list[torch.Tensor]]:
    k = math.ceil(RATIO * N)
    u = [torch.zeros(N) for _ in range(WORLD)]
    v = [torch.zeros(N) for _ in range(WORLD)]
    outs = []
    for s in range(steps):
        total = torch.zeros(N)
        for r in range(WORLD):
            u[r] = MOM * u[r] + runs[r]["grads"][s]
            v[r] = v[r] + u[r]
            idx = v[r].abs().topk(k).indices
            total[idx] += v[r][idx]
            v[r][idx] = 0.0
            if masking:
                u[r][idx] = 0.0
        outs.append(total / WORLD)
    return outs, u, v


# --- momentum correction ---------------------------------------------------------------------------
@pytest.mark.parametrize("masking", [False, True])
def test_momentum_correction_accumulates_velocity_into_the_residual(runs, masking):
    outs, u, v = _ref_mc(runs, 2, masking)
    for r in range(WORLD):
        d = runs[r][("mc", masking)]
        for s in range(2):
            torch.testing.assert_close(d["outs"][s], outs[s])
        torch.testing.assert_close(d["vel"], u[r])
        torch.testing.assert_close(d["res"], v[r])
    plain, _, _ = _ref_mc(runs, 2, not masking)
    assert not torch.allclose(plain[1], outs[1]), "test data too weak: masking changed nothing"


def test_momentum_masking_zeroes_velocity_where_entries_were_sent(runs):
    k = math.ceil(RATIO * N)
    for r in range(WORLD):
        on, off = runs[r][("mc", True)], runs[r][("mc", False)]
        sent = on["res"] == 0  # error feedback zeroes the residual exactly where it sent
        assert int(sent.sum()) == k
        assert torch.all(on["vel"][sent] == 0)
        assert torch.all(on["vel"][~sent] != 0)
        assert torch.all(off["vel"] != 0)
        assert on["masked"] == 2 * k and off["masked"] == 0
        assert "momentum masking: 8 velocity entries zeroed" in on["describe"]


@pytest.mark.parametrize("mode", ["topk", "hierarchical_topk"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_correction_at_ratio_one_reproduces_momentum_sgd(runs, mode, nesterov):
    for r in range(WORLD):
        assert runs[r][("mc1_steps", mode, nesterov)] == (2, 4)  # crosses the dense warm-up -> compressed switch
        torch.testing.assert_close(runs[r][("mc1", mode, nesterov)], runs[r][("sgd", nesterov)], rtol=1e-5,
                                   atol=1e-6)
    assert not torch.allclose(runs[0]["mc_sparse"], runs[0][("sgd", False)], atol=1e-4), \
        "ratio 0.05 should differ from dense momentum SGD"


def test_velocities_survive_state_dict_round_trip_and_resize_drops_them(runs):
    for r in range(WORLD):
        d = runs[r]
        assert d["rt_vel_equal"] and d["rt_vel_keys"] == ["a", "b"]
        a, b = d["rt_continue"]
        assert torch.equal(a, b)
        assert d["resized_vel"] == 0
        assert "2 velocities dropped" in d["resized_describe"]


def test_per_layer_selection_sends_the_ratio_of_each_parameter(runs):
    total, off = torch.zeros(N), 0
    for _, size in LAYOUT:
        k = math.ceil(RATIO * size)  # 3 of a's 24, 2 of b's 16
        for r in range(WORLD):
            seg = runs[r]["grads"][0][off:off + size]
            idx = seg.abs().topk(k).indices
            total[off + idx] += seg[idx]
        off += size
    for r in range(WORLD):
        torch.testing.assert_close(runs[r]["per_layer_out"], total / WORLD)
    assert runs[0]["per_layer_bytes"] == allgather_bytes(8 * (3 + 2), WORLD)


# --- local clipping, warm-up -------------------------------------------------------------------------
def test_local_clip_scales_each_worker_gradient_to_threshold_over_sqrt_world(runs):
    k = math.ceil(RATIO * N)
    limit = 0.5 / math.sqrt(WORLD)
    total = torch.zeros(N)
    for r in range(WORLD):
        g = runs[r]["grads"][0]
        g = g * (limit / g.norm())
        idx = g.abs().topk(k).indices
        total[idx] += g[idx]
    for r in range(WORLD):
        torch.testing.assert_close(runs[r]["clip_out"], total / WORLD)
        assert runs[r]["clip_counts"] == (1, 1)


def test_warmup_ratio_ramps_exponentially_by_epochs_of_samples():
    assert warmup_ratio(0.01, 0.25, 4.0, 0.0) == 0.25
    assert warmup_ratio(0.01, 0.25, 4.0, 1.0) == pytest.approx(0.25 * 0.04 ** 0.25)
    assert warmup_ratio(0.01, 0.25, 4.0, 2.0) == pytest.approx(0.05)
    assert warmup_ratio(0.01, 0.25, 4.0, 4.0) == 0.01
    assert warmup_ratio(0.01, 0.25, 4.0, 9.0) == 0.01
    assert warmup_ratio(0.01, 0.25, 0.0, 0.0) == 0.01  # off
    # Driven by samples seen: 1.5 epochs of a 1000-image set at any batch size is the same point.
    assert warmup_ratio(0.01, 0.25, 4.0, 1500 / 1000) == pytest.approx(0.25 * 0.04 ** (1.5 / 4))


def test_sparsity_warmup_sends_more_entries_early_in_the_hook(runs):
    ks = [math.ceil(warmup_ratio(RATIO, 0.5, 2.0, e) * N) for e in (0.0, 1.0, 2.0, 3.0)]
    assert ks == [20, 9, 4, 4]
    assert runs[0]["warmup_bytes"] == [allgather_bytes(8 * k, WORLD) for k in ks]
    assert "ratio 0.1 at epoch 3.00" in runs[0]["warmup_describe"]


# --- selection ---------------------------------------------------------------------------------------
def _real_gradient() -> torch.Tensor:
    """The flat gradient of a small conv net on random images (about 100k entries)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3), torch.nn.ReLU(),
                              torch.nn.Conv2d(64, 128, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                              torch.nn.Linear(128, 10))
    x = torch.randn(8, 3, 16, 16)
    torch.nn.functional.cross_entropy(net(x), torch.randint(0, 10, (8,))).backward()
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()])


@pytest.mark.parametrize("ratio", [0.01, 0.001])
def test_sampled_selection_keeps_the_largest_entries_of_a_real_gradient(ratio):
    g = _real_gradient()
    assert g.numel() >= compress.MIN_SAMPLED
    mag = g.abs()
    k = compress.k_for(ratio, g.numel())
    stats = compress.SelectionStats()
    idx, pad = compress.select(mag, k, "sampled", torch.Generator().manual_seed(0), stats)
    assert stats.sampled == 1 and stats.fallbacks == 0
    assert idx.numel() == k
    real = idx[: k - pad]
    assert len(set(real.tolist())) == k - pad >= compress.LOW * k
    exact = set(compress.exact_topk(mag, k).tolist())
    largest = set(mag.topk(k - pad).indices.tolist())
    assert largest <= set(real.tolist())  # the count largest entries are always among those sent
    if pad == 0:
        assert set(real.tolist()) == exact


def test_sampled_selection_falls_back_to_exact_on_adversarial_distributions():
    n, k = 100_000, 1000
    # Most entries tie at one magnitude: the sampled threshold selects nearly everything.
    tied = torch.ones(n)
    tied[torch.randperm(n, generator=torch.Generator().manual_seed(1))[:k // 4]] = 5.0
    # Fewer non-zero entries than k (dead units, unused embedding rows): the sample sees only zeros.
    sparse = torch.zeros(n)
    sparse[torch.randperm(n, generator=torch.Generator().manual_seed(2))[:300]] = torch.rand(300) + 0.1
    for mag in (tied, sparse):
        stats = compress.SelectionStats()
        idx, pad = compress.select(mag, k, "sampled", torch.Generator().manual_seed(0), stats)
        assert stats.fallbacks == 1 and pad == 0
        assert idx.numel() == k
        assert torch.equal(mag[idx].sort().values, mag.topk(k).values.sort().values)


def test_sampled_selection_in_the_hook_matches_exact_and_meters_the_same_bytes(runs):
    for r in range(WORLD):
        (ex, ex_bytes, _), (sa, sa_bytes, sampled) = runs[r]["selection"]["exact"], runs[r]["selection"]["sampled"]
        assert sampled == 1
        assert sa_bytes == ex_bytes == allgather_bytes(8 * compress.k_for(0.01, 60_000), WORLD)
        torch.testing.assert_close(sa, ex)


# --- overlap -----------------------------------------------------------------------------------------
def test_compressed_buckets_return_futures_timed_per_bucket(runs):
    t = runs[0][("timings", "topk", False)]
    buckets = {i for i, _, _ in t}
    assert len(buckets) >= 2, "expected several buckets per step"
    # Every bucket of every step completed through its future (DDP rebuilds its buckets after step 1).
    assert len(t) >= 5 * len(buckets)
    assert all(done >= call for _, call, done in t)
