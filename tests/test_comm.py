"""Gradient communication modes on real gloo process groups (4 processes = 2 simulated nodes x 2).

Two process spawns feed all tests (module fixtures), to keep the start-up cost of torch in 4
processes on a 2-core machine to twice: one runs the hook on known tensors, the other runs short
real DDP trainings per mode plus a checkpoint/resume.
"""

from __future__ import annotations

import math
import os
import pathlib

import pytest
import torch

from lightray.comm import auto as comm_auto
from lightray.comm.hook import AUTO_MEASURE_STEPS, CommHook
from lightray.comm.topology import Topology, build_groups
from lightray.comm.wire import allgather_bytes, ring_allreduce_bytes
from lightray.config import CommConfig, ConfigError, load_config
from lightray.train.state import load_rank_state, save_rank_state
from lightray.units import pop_unit_events
from tests.comm_net import spawn_ranks

WORLD = 4
PER_NODE = 2
N = 40
LAYOUT = [("a", 24), ("b", 16)]
RATIO = 0.1  # k = 4 of 40 (flat), 2 of each 20-entry chunk (hierarchical)
N_AUTO = 200_000  # comm.mode=auto: a gradient large enough for bytes, not latency, to decide on a slow link
SLOW_GBPS, FAST_GBPS = 0.01, 1e4


def _grads(rank: int, step: int, integer: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    if integer:
        return torch.randint(-50, 50, (N,), generator=g).float()
    return torch.randn(N, generator=g)


def _init(rank: int, world: int, folder: str) -> Topology:
    return Topology.simulated(world, rank, PER_NODE)  # the group itself is the session's (tests/comm_net.py)


def _hook(topo: Topology, **kw) -> CommHook:
    # fp32 payload unless told: the known-tensor checks compare exact sums and count 8-byte entries
    cfg = CommConfig(**{"warmup_steps": 0, "ratio": RATIO, "payload": "fp32", **kw})
    return CommHook(cfg, topo, torch.device("cpu"))


def _known_tensor_worker(rank: int, world: int, folder: str) -> None:
    topo = _init(rank, world, folder)
    out: dict = {}
    h = _hook(topo, mode="dense")
    out["dense"] = h.aggregate(_grads(rank, 0, integer=True), LAYOUT)
    out["dense_bytes"] = h.bytes_sent
    for mode in ("fp16", "bf16"):
        out[mode] = _hook(topo, mode=mode).aggregate(_grads(rank, 0), LAYOUT)
    for mode in ("topk", "hierarchical_topk"):
        for ef in (True, False):
            h = _hook(topo, mode=mode, error_feedback=ef)
            o1 = h.aggregate(_grads(rank, 1), LAYOUT)
            r1 = torch.cat([h.residuals().get(n, torch.zeros(c)) for n, c in LAYOUT])
            o2 = h.aggregate(_grads(rank, 2), LAYOUT)
            out[(mode, ef)] = {"out1": o1, "res1": r1, "out2": o2, "bytes": h.bytes_sent,
                               "inter": h.bytes_inter_node, "dense_bytes": h.dense_bytes}
            if mode == "topk" and ef:
                # Checkpoint round trip: a fresh hook loaded from the state continues identically.
                sd = h.state_dict()
                fresh = _hook(topo, mode=mode, error_feedback=ef)
                fresh.load_state_dict(sd, world_size=world)
                out["roundtrip_residuals_equal"] = all(torch.equal(fresh.residuals()[k], v)
                                                       for k, v in h.residuals().items())
                out["roundtrip_keys"] = sorted(fresh.residuals())
                out["roundtrip_step"] = fresh.step
                out["continue_orig"] = h.aggregate(_grads(rank, 3), LAYOUT)
                out["continue_loaded"] = fresh.aggregate(_grads(rank, 3), LAYOUT)
                # Resume with another worker count: residuals dropped, the next step dense.
                resized = _hook(topo, mode=mode, error_feedback=ef)
                resized.load_state_dict(sd, world_size=world + 4)
                out["resized_residuals"] = len(resized.residuals())
                out["resized_step_out"] = resized.aggregate(_grads(rank, 0, integer=True), LAYOUT)
                out["resized_then"] = resized.aggregate(_grads(rank, 1), LAYOUT)
                out["resized_describe"] = resized.describe()
    # Warm-up: the first step dense, the second compressed.
    h = _hook(topo, mode="topk", warmup_steps=1)
    out["warm1"] = h.aggregate(_grads(rank, 0, integer=True), LAYOUT)
    out["warm2"] = h.aggregate(_grads(rank, 1), LAYOUT)
    # DDP rebuilds buckets: the same parameters arrive in another order; residuals follow the names.
    h = _hook(topo, mode="topk")
    h.aggregate(_grads(rank, 1), LAYOUT)
    before = h.residuals()
    swapped = [LAYOUT[1], LAYOUT[0]]
    h.aggregate(torch.zeros(N), swapped)  # zero gradient: only residuals are sent
    out["rebuild_before"] = before
    out["rebuild_after"] = h.residuals()
    # Ranks that disagree after a resume (rank 0 restored at step 7, others fresh in warm-up)
    # still take the same decisions: all adopt step 7 and compress.
    h = _hook(topo, mode="topk", warmup_steps=5)
    if rank == 0:
        donor = _hook(topo, mode="topk", warmup_steps=5)
        sd = donor.state_dict()
        sd["step"] = 7
        h.load_state_dict(sd, world_size=world)
    out["agree_out"] = h.aggregate(_grads(rank, 1), LAYOUT)
    out["agree_step"] = h.step
    out["groups"] = build_groups(topo)
    # comm.mode=auto: one measured dense step, then the crossover model picks for the link speed.
    pop_unit_events()
    layout = [("w", N_AUTO)]
    for name, gbps in (("slow", SLOW_GBPS), ("fast", FAST_GBPS)):
        h = _hook(topo, mode="auto", link_gbps=gbps, ratio=0.01)
        first = h.aggregate(_auto_grads(rank, 0), layout)
        for step in range(1, AUTO_MEASURE_STEPS):
            h.aggregate(_auto_grads(rank, step), layout)
        inter0 = h.bytes_inter_node / AUTO_MEASURE_STEPS  # one measured (dense) step
        h.aggregate(_auto_grads(rank, AUTO_MEASURE_STEPS), layout)
        out[f"auto_{name}"] = {"mode": h.mode, "first": first, "inter_measured_step": inter0,
                               "inter_decided_step": h.bytes_inter_node - AUTO_MEASURE_STEPS * inter0,
                               "describe": h.describe(),
                               "events": [e for e in pop_unit_events() if e["unit"] == "comm_auto"],
                               "state": h.state_dict()}
    # Resume: the saved choice is kept on the same layout (a faster link now would not flip it), and decided
    # again on another worker count.
    kept = _hook(topo, mode="auto", link_gbps=FAST_GBPS, ratio=0.01)
    kept.load_state_dict(out["auto_slow"]["state"], world_size=world)
    regrown = _hook(topo, mode="auto", link_gbps=FAST_GBPS, ratio=0.01)
    regrown.load_state_dict(out["auto_slow"]["state"], world_size=world + 4)
    out["auto_kept"] = {"mode": kept.mode, "residuals": len(kept.residuals()), "regrown_mode": regrown.mode,
                        "regrown_describe": regrown.describe()}
    torch.save(out, os.path.join(folder, f"out{rank}.pt"))


def _auto_grads(rank: int, step: int) -> torch.Tensor:
    return torch.randn(N_AUTO, generator=torch.Generator().manual_seed(5000 + 10 * step + rank))


def _spawn(fn, folder: pathlib.Path, world: int = WORLD) -> list[dict]:
    return spawn_ranks(fn, world, folder)


@pytest.fixture(scope="module")
def known(tmp_path_factory) -> list[dict]:
    return _spawn(_known_tensor_worker, tmp_path_factory.mktemp("known"))


# --- reference computations (written independently of the hook) ----------------------------------
def _sparse_topk(acc: torch.Tensor, k: int) -> torch.Tensor:
    idx = acc.abs().topk(k).indices
    out = torch.zeros_like(acc)
    out[idx] = acc[idx]
    return out


def _ref_topk(steps: list[int], ef: bool) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    k = math.ceil(RATIO * N)
    res = [torch.zeros(N) for _ in range(WORLD)]
    outs, resid = [], []
    for s in steps:
        total = torch.zeros(N)
        for r in range(WORLD):
            acc = _grads(r, s) + (res[r] if ef else 0)
            sent = _sparse_topk(acc, k)
            total += sent
            res[r] = acc - sent if ef else torch.zeros(N)
        outs.append(total / WORLD)
        resid.append([x.clone() for x in res])
    return outs, resid


def _ref_hier(steps: list[int], ef: bool) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Top-k over node sums: node n's sum cut into PER_NODE chunks, chunk j sparsified by local rank j."""
    c = math.ceil(N / PER_NODE)
    k = math.ceil(RATIO * c)
    res = [torch.zeros(N) for _ in range(WORLD)]  # rank r holds the residual of its node's chunk
    outs, resid = [], []
    for s in steps:
        total = torch.zeros(N)
        for node in range(WORLD // PER_NODE):
            node_sum = sum(_grads(node * PER_NODE + j, s) for j in range(PER_NODE))
            for j in range(PER_NODE):
                r = node * PER_NODE + j
                sl = slice(j * c, (j + 1) * c)
                acc = node_sum[sl] + (res[r][sl] if ef else 0)
                sent = _sparse_topk(acc, k)
                total[sl] += sent
                res[r] = torch.zeros(N)
                if ef:
                    res[r][sl] = acc - sent
        outs.append(total / WORLD)
        resid.append([x.clone() for x in res])
    return outs, resid


def _mean(step: int, integer: bool = False) -> torch.Tensor:
    return torch.stack([_grads(r, step, integer) for r in range(WORLD)]).mean(0)


# --- known tensors ---------------------------------------------------------------------------------
def test_dense_gives_exact_mean_on_every_rank(known):
    for r in range(WORLD):
        assert torch.equal(known[r]["dense"], _mean(0, integer=True))


def test_half_precision_modes_give_mean_within_their_precision(known):
    for r in range(WORLD):
        torch.testing.assert_close(known[r]["fp16"], _mean(0), atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(known[r]["bf16"], _mean(0), atol=2e-2, rtol=2e-2)


def test_topk_sends_the_largest_entries_and_averages_them(known):
    outs, _ = _ref_topk([1], ef=True)
    for r in range(WORLD):
        got = known[r][("topk", True)]["out1"]
        assert torch.equal(got != 0, outs[0] != 0), "selected indices differ from the reference top-k"
        torch.testing.assert_close(got, outs[0])


def test_topk_residual_keeps_unsent_entries_and_is_applied_next_step(known):
    outs, resid = _ref_topk([1, 2], ef=True)
    for r in range(WORLD):
        d = known[r][("topk", True)]
        torch.testing.assert_close(d["res1"], resid[0][r])
        assert torch.count_nonzero(d["res1"]) == N - math.ceil(RATIO * N)
        torch.testing.assert_close(d["out2"], outs[1])
    no_ef, _ = _ref_topk([1, 2], ef=False)
    assert not torch.allclose(outs[1], no_ef[1]), "test data too weak: error feedback changed nothing"


def test_topk_without_error_feedback_forgets_unsent_entries(known):
    outs, _ = _ref_topk([1, 2], ef=False)
    for r in range(WORLD):
        d = known[r][("topk", False)]
        assert torch.count_nonzero(d["res1"]) == 0
        torch.testing.assert_close(d["out2"], outs[1])


@pytest.mark.parametrize("ef", [True, False])
def test_hierarchical_equals_topk_over_node_sums_per_chunk(known, ef):
    outs, resid = _ref_hier([1, 2], ef=ef)
    for r in range(WORLD):
        d = known[r][("hierarchical_topk", ef)]
        torch.testing.assert_close(d["out1"], outs[0])
        torch.testing.assert_close(d["out2"], outs[1])
        torch.testing.assert_close(d["res1"], resid[0][r])


def test_byte_meter_counts_ring_allreduce_and_allgather_bytes(known):
    k = math.ceil(RATIO * N)
    c = N // PER_NODE
    kc = math.ceil(RATIO * c)
    nodes = WORLD // PER_NODE
    d0 = known[0]
    assert d0["dense_bytes"] == ring_allreduce_bytes(4 * N, WORLD) == 2 * 3 * 4 * N // 4
    topk = d0[("topk", True)]
    assert topk["bytes"] == 2 * allgather_bytes(8 * k, WORLD)  # two steps of (W-1) * (values + int32 indices)
    assert topk["bytes"] / topk["dense_bytes"] == pytest.approx((WORLD - 1) * 8 * k / (2 * (WORLD - 1) / WORLD * 4 * N))
    hier = d0[("hierarchical_topk", True)]
    per_step_inter = allgather_bytes(8 * kc, nodes)
    per_step = ring_allreduce_bytes(4 * N, PER_NODE) + per_step_inter + allgather_bytes(4 * c, PER_NODE)
    assert hier["bytes"] == 2 * per_step
    assert hier["inter"] == 2 * per_step_inter


def test_warmup_steps_run_dense_before_compression(known):
    outs, _ = _ref_topk([1], ef=True)
    for r in range(WORLD):
        assert torch.equal(known[r]["warm1"], _mean(0, integer=True))
        torch.testing.assert_close(known[r]["warm2"], outs[0])


def test_residuals_survive_state_dict_round_trip(known):
    for r in range(WORLD):
        d = known[r]
        assert d["roundtrip_residuals_equal"]
        assert d["roundtrip_keys"] == ["a", "b"]  # keyed by parameter name, not bucket position
        assert d["roundtrip_step"] == 2
        assert torch.equal(d["continue_orig"], d["continue_loaded"])


def test_resume_with_other_worker_count_drops_residuals_and_runs_one_dense_step(known):
    outs, _ = _ref_topk([1], ef=True)
    for r in range(WORLD):
        d = known[r]
        assert d["resized_residuals"] == 0
        assert torch.equal(d["resized_step_out"], _mean(0, integer=True))
        torch.testing.assert_close(d["resized_then"], outs[0])  # compression resumes, from empty residuals
        assert "residuals dropped" in d["resized_describe"]


def test_residuals_follow_parameter_names_when_buckets_are_rebuilt(known):
    k = math.ceil(RATIO * N)
    for r in range(WORLD):
        before, after = known[r]["rebuild_before"], known[r]["rebuild_after"]
        assert set(after) == {"a", "b"}
        # The zero-gradient step sent the k largest residual entries; the rest stay where they were.
        flat_before = torch.cat([before["a"], before["b"]])
        flat_after = torch.cat([after["a"], after["b"]])
        expected = flat_before - _sparse_topk(flat_before, k)
        torch.testing.assert_close(flat_after, expected)


def test_ranks_agree_on_step_after_uneven_resume(known):
    outs, _ = _ref_topk([1], ef=True)
    for r in range(WORLD):
        assert known[r]["agree_step"] == 8
        torch.testing.assert_close(known[r]["agree_out"], outs[0])


def test_groups_pair_node_members_and_same_local_ranks(known):
    node_groups, cross_groups = known[0]["groups"]
    assert node_groups == [[0, 1], [2, 3]]
    assert cross_groups == [[0, 2], [1, 3]]


# --- real DDP trainings ------------------------------------------------------------------------------
MODES = ["dense", "fp16", "bf16", "topk", "hierarchical_topk", "powersgd"]


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(16, 4, generator=g)
    x = torch.randn(WORLD * 64, 16, generator=g)
    y = (x @ w).argmax(1)
    return x[rank::WORLD], y[rank::WORLD]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 4))


def _train(ddp, opt, x, y, steps: int, hook: CommHook | None = None) -> list[float]:
    losses = []
    for _ in range(steps):
        if hook is not None:
            hook.begin_step(0.0)  # as the trainer does at every step: a built-in path counts the step here
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _ddp_worker(rank: int, world: int, folder: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    topo = _init(rank, world, folder)
    x, y = _data(rank)
    out: dict = {}
    for mode in MODES:
        model = _model()
        # Tiny buckets: several per step, so DDP's bucket rebuild after step 1 is exercised.
        ddp = DDP(model, bucket_cap_mb=0.004)
        hook = _hook(topo, mode=mode, ratio=0.05, warmup_steps=3, payload="compact")
        hook.install(ddp)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = _train(ddp, opt, x, y, 40, hook)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out[mode] = {"losses": losses, "params": flat, "bytes": hook.bytes_sent, "inter": hook.bytes_inter_node,
                     "dense_bytes": hook.dense_bytes,
                     "describe": hook.describe(), "compressed": hook.compressed_steps}
    # dense, and fp16 without a warm-up, through DDP's own path and through lightray's hook (comm.builtin).
    for mode in ("dense", "fp16"):
        for builtin in (True, False):
            model = _model()
            ddp = DDP(model, bucket_cap_mb=0.004)
            hook = _hook(topo, mode=mode, warmup_steps=0, builtin=builtin)
            hook.install(ddp)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            _train(ddp, opt, x, y, 10, hook)
            out[("builtin", mode, builtin)] = {
                "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]), "bytes": hook.bytes_sent,
                "inter": hook.bytes_inter_node, "dense_bytes": hook.dense_bytes, "steps": hook.dense_steps
                + hook.compressed_steps, "path": hook.stats()["comm_path"], "describe": hook.describe()}
    # Resume as exact continuation: top-k + EF, one bucket (so the selection does not depend on
    # how DDP splits the buckets before and after its rebuild).
    def fresh():
        model = _model()
        ddp = DDP(model, bucket_cap_mb=100)
        hook = _hook(topo, mode="topk", ratio=0.05, warmup_steps=2, payload="compact")
        hook.install(ddp)
        return model, ddp, hook, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, ddp, hook, opt = fresh()
    _train(ddp, opt, x, y, 6)
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "opt": opt.state_dict(), "comm": hook.state_dict()}
    # Through the trainer's own state files, which load with weights_only=True.
    save_rank_state(os.path.join(folder, "ckpt"), rank, saved, {"samples_seen": 6, "world_size": world})
    saved = load_rank_state(os.path.join(folder, "ckpt"), rank)
    _train(ddp, opt, x, y, 5)
    out["resume_uninterrupted"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for with_comm in (True, False):
        model, ddp, hook, opt = fresh()
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        if with_comm:
            hook.load_state_dict(saved["comm"], world_size=world)
        else:
            hook.step = saved["comm"]["step"]  # same warm-up position, residuals lost
        _train(ddp, opt, x, y, 5)
        out[f"resumed_comm_{with_comm}"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # comm.mode=auto through DDP on a slow link: decided inside the hook, at a bucket, after the measured steps.
    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.004)
    hook = _hook(topo, mode="auto", link_gbps=0.001, ratio=0.05, warmup_steps=3, payload="compact")
    hook.install(ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = _train(ddp, opt, x, y, 40)
    out["auto"] = {"losses": losses, "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                   "mode": hook.mode, "compressed": hook.compressed_steps, "inter": hook.bytes_inter_node,
                   "describe": hook.describe(), "evidence": hook.auto_evidence}
    torch.save(out, os.path.join(folder, f"out{rank}.pt"))


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> list[dict]:
    return _spawn(_ddp_worker, tmp_path_factory.mktemp("ddp"))


@pytest.mark.parametrize("mode", MODES)
def test_real_ddp_training_loss_falls_and_replicas_stay_equal(ddp_runs, mode):
    losses = ddp_runs[0][mode]["losses"]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.6 * first, f"{mode}: loss {first:.3f} -> {last:.3f}"
    for r in range(1, WORLD):
        torch.testing.assert_close(ddp_runs[r][mode]["params"], ddp_runs[0][mode]["params"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["fp16", "bf16", "topk", "hierarchical_topk", "powersgd"])
def test_real_ddp_compressed_modes_send_fewer_bytes_across_nodes_than_dense(ddp_runs, mode):
    d, dense = ddp_runs[0][mode], ddp_runs[0]["dense"]
    assert d["compressed"] > 0
    assert d["inter"] < dense["inter"], d["describe"]
    assert d["dense_bytes"] == dense["bytes"]
    if mode != "hierarchical_topk":  # hierarchical adds intra-node traffic on purpose
        assert d["bytes"] < dense["bytes"], d["describe"]


@pytest.mark.parametrize("mode", ["dense", "fp16"])
def test_dense_and_fp16_through_ddps_own_path_train_and_count_bytes_as_lightrays_hook_does(ddp_runs, mode):
    """Where no lightray unit needs the bucket, DDP's own all-reduce (dense) and torch's fp16_compress_hook do the
    same arithmetic as lightray's hook without a Python call per bucket: the same parameters after 10 steps,
    bit for bit, and the same bytes counted (per step, from the gradient's size, instead of per bucket)."""
    for r in range(WORLD):
        own, hook = ddp_runs[r][("builtin", mode, True)], ddp_runs[r][("builtin", mode, False)]
        assert own["path"] == ("DDP's own all-reduce" if mode == "dense" else "torch's fp16_compress_hook")
        assert hook["path"] == "lightray hook" and "no lightray hook" in own["describe"]
        assert torch.equal(own["params"], hook["params"])
        assert (own["bytes"], own["inter"], own["dense_bytes"], own["steps"]) == (
            hook["bytes"], hook["inter"], hook["dense_bytes"], hook["steps"]) and own["steps"] == 10


def test_real_ddp_resume_with_residuals_continues_exactly(ddp_runs):
    for r in range(WORLD):
        d = ddp_runs[r]
        assert torch.equal(d["resumed_comm_True"], d["resume_uninterrupted"])
        assert not torch.equal(d["resumed_comm_False"], d["resume_uninterrupted"]), "residuals made no difference"


def test_real_ddp_auto_picks_hierarchical_topk_on_a_slow_link_and_trains(ddp_runs):
    d = ddp_runs[0]["auto"]
    assert d["mode"] == "hierarchical_topk", d["describe"]
    assert d["compressed"] == 40 - 3 and d["inter"] < ddp_runs[0]["dense"]["inter"] / 5
    first, last = sum(d["losses"][:3]) / 3, sum(d["losses"][-3:]) / 3
    assert last < 0.6 * first
    ev = d["evidence"]
    assert ev["costs"]["buckets"] > 1 and ev["costs"]["elements"] == sum(p.numel() for p in _model().parameters())
    assert ev["costs"]["overlap_s"] > 0  # the backward window between the first and the last bucket was measured
    for r in range(1, WORLD):
        assert ddp_runs[r]["auto"]["mode"] == d["mode"]
        torch.testing.assert_close(ddp_runs[r]["auto"]["params"], d["params"], rtol=0, atol=1e-6)


# --- comm.mode=auto on known tensors ---------------------------------------------------------------
def test_auto_runs_its_first_step_dense_then_picks_compression_on_a_slow_link(known):
    mean0 = torch.stack([_auto_grads(r, 0) for r in range(WORLD)]).mean(0)
    for r in range(WORLD):
        d = known[r]["auto_slow"]
        assert d["mode"] == "hierarchical_topk"
        torch.testing.assert_close(d["first"], mean0)  # the measured step: a dense mean
        assert d["inter_decided_step"] * 50 < d["inter_measured_step"]  # compressed between nodes from the next step
        assert d["state"]["auto_choice"] == "hierarchical_topk"
        (event,) = d["events"]
        assert event["chosen"] == "hierarchical_topk" and event["link_gbps"] == SLOW_GBPS
        assert event["message"].startswith(f"picked hierarchical_topk for a {SLOW_GBPS:g} Gbps link between 2 node(s)")
        assert "modelled step dense" in event["message"] and "compression" in event["message"]
        assert event["modes"]["hierarchical_topk"] < event["modes"]["dense"]
        assert "auto for 0.01 Gbps -> hierarchical top-k" in d["describe"]


def test_auto_keeps_dense_on_a_fast_link(known):
    for r in range(WORLD):
        d = known[r]["auto_fast"]
        assert d["mode"] == "dense" and d["inter_decided_step"] == d["inter_measured_step"]
        (event,) = d["events"]
        assert event["chosen"] == "dense" and event["message"].startswith(f"picked dense for a {FAST_GBPS:g} Gbps")
        assert min(event["modes"].values()) == event["modes"]["dense"] or \
            min(event["modes"].values()) > (1 - comm_auto.AUTO_MARGIN) * event["modes"]["dense"]


def test_auto_keeps_its_choice_on_resume_and_decides_again_on_a_new_layout(known):
    for r in range(WORLD):
        d = known[r]["auto_kept"]
        assert d["mode"] == "hierarchical_topk" and d["residuals"] == 1  # kept, residuals with it
        assert d["regrown_mode"] == "dense" and "undecided" in d["regrown_describe"]


def test_auto_needs_a_link_speed_and_validates_it():
    with pytest.raises(ConfigError, match=r"comm.link_gbps: bad value 0; comm.mode=auto needs the link speed"):
        load_config("demo", {"comm.mode": "auto"})
    with pytest.raises(ConfigError, match=r"comm.link_gbps: bad value -1.0; expected a number in \[0, 1e\+06\]"):
        load_config("demo", {"comm.mode": "auto", "comm.link_gbps": "-1"})
    with pytest.raises(ConfigError, match="comm.link_gbps: bad value 'fast'; expected a number"):
        load_config("demo", {"comm.mode": "auto", "comm.link_gbps": "fast"})
    cfg = load_config("demo", {"comm.mode": "auto", "comm.link_gbps": "25"})
    assert (cfg.comm.mode, cfg.comm.link_gbps) == ("auto", 25.0)


# --- the crossover model (pure arithmetic) ---------------------------------------------------------
RESNET50 = comm_auto.StepCosts(elements=25_557_032, buckets=4, ratio=0.01, compress_s=0.05, cast_s=0.01,
                               overlap_s=0.1, compute_s=0.213)


def test_crossover_model_picks_compression_below_the_crossover_and_dense_above():
    c = comm_auto.Cluster(nodes=16, workers_per_node=8, link_gbps=25.0)
    x = comm_auto.crossover_gbps("hierarchical_topk", c, RESNET50)
    assert 1 < x < 100
    top = max(x, comm_auto.crossover_gbps("bf16", c, RESNET50))
    slow, fast = comm_auto.Cluster(16, 8, x / 10), comm_auto.Cluster(16, 8, top * 2)
    assert comm_auto.choose(slow, RESNET50, ["bf16", "hierarchical_topk"])[0] == "hierarchical_topk"
    assert comm_auto.choose(fast, RESNET50, ["bf16", "hierarchical_topk"])[0] == "dense"
    at = comm_auto.Cluster(16, 8, x)
    assert comm_auto.step_s("hierarchical_topk", at, RESNET50) == pytest.approx(
        comm_auto.step_s("dense", at, RESNET50), rel=1e-3)


def test_overlap_hides_dense_communication_and_lowers_the_crossover():
    c = comm_auto.Cluster(16, 8, 25.0)
    hidden = comm_auto.crossover_gbps("hierarchical_topk", c, RESNET50)
    exposed = comm_auto.crossover_gbps("hierarchical_topk", c,
                                       comm_auto.StepCosts(**{**RESNET50.__dict__, "overlap_s": 0.0}))
    assert exposed > hidden
    # a dense all-reduce shorter than the backward window costs nothing extra
    rows = comm_auto.table(comm_auto.Cluster(16, 8, 1000.0), RESNET50, ["dense"])
    assert rows["dense"]["step_s"] == pytest.approx(RESNET50.compute_s)


def test_hierarchical_dense_sends_less_over_the_link_than_a_flat_ring():
    c = comm_auto.Cluster(16, 8, 25.0)
    size = 4 * RESNET50.elements
    flat, hier = (comm_auto.parts(m, c, RESNET50)["inter_bytes"] for m in ("dense", "hierarchical_dense"))
    assert flat == pytest.approx(2 * 127 / 128 * size) and hier == pytest.approx(2 * 15 / 16 * size)
    # hierarchical top-k crosses each node's link with (N-1) 8k bytes: the all-gather grows with the nodes
    hier_topk = comm_auto.parts("hierarchical_topk", c, RESNET50)["inter_bytes"]
    assert hier_topk == pytest.approx(15 * 8 * 0.01 * RESNET50.elements) and hier_topk * 6 < flat
    # one node: nothing crosses, and hierarchical top-k is the dense reduction
    one = comm_auto.Cluster(1, 8, 25.0)
    assert comm_auto.parts("dense", one, RESNET50)["inter_bytes"] == 0
    assert comm_auto.step_s("hierarchical_topk", one, RESNET50) == comm_auto.step_s("dense", one, RESNET50)


def test_auto_measures_compression_and_casts_on_the_device_scaled_to_the_gradient(monkeypatch):
    cpu = torch.device("cpu")
    assert comm_auto.time_compression(50_000, 0.01, "sampled", cpu, max_elements=50_000, reps=3) > 0
    # The scaling rule, on a clock that gives every timed pass 1 s: a 5M-entry gradient timed on 50k entries
    # is 100 passes. (Two real timings compared here failed once in CI: one 50k pass took 43 ms on a loaded
    # machine, 60 times its usual.)
    ticks = iter(range(1000))
    monkeypatch.setattr(comm_auto, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: next(ticks))}))
    small = comm_auto.time_compression(50_000, 0.01, "sampled", cpu, max_elements=50_000, reps=3)
    scaled = comm_auto.time_compression(5_000_000, 0.01, "sampled", cpu, max_elements=50_000, reps=3)
    assert (small, scaled) == (1.0, 100.0)
    monkeypatch.undo()
    assert comm_auto.time_cast(50_000, torch.bfloat16, cpu) > 0
    assert comm_auto.half_mode(cpu) == "bf16"
