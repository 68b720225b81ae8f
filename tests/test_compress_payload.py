"""The compact sparse payload (comm.payload=compact): fp16 values whose rounding error stays in the residual,
16-bit block offsets of the sorted indices plus a per-block count. Pack/unpack and the residual on known
tensors; the all-gathered result and the bytes handed to the collectives on 2 real gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch

from lightray.comm.compress import (
    FP16_MAX,
    INDEX_BLOCK,
    index_blocks,
    pack,
    payload_nbytes,
    quantize,
    scatter_sum,
    unpack,
)
from lightray.comm.hook import CommHook
from lightray.comm.topology import Topology
from lightray.config import CommConfig
from tests.comm_net import spawn_ranks

N = 3 * INDEX_BLOCK + 123  # four index blocks, the last one partial
FP16_EPS = 2.0 ** -11  # fp16's relative rounding error (10 stored mantissa bits)


def _values(n: int, seed: int, extremes: bool = True) -> torch.Tensor:
    v = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    if extremes:
        v[:3] = torch.tensor([1e5, -2e5, 3e-9])  # beyond fp16's range, and below its smallest subnormal
    return v


def test_compact_pack_round_trips_indices_exactly_and_values_within_fp16_rounding():
    gen = torch.Generator().manual_seed(0)
    k = 3000
    # indices in every block, the chunk's first and last entries among them, in no order
    idx = torch.cat([torch.tensor([0, N - 1, INDEX_BLOCK - 1, INDEX_BLOCK]), torch.randperm(N - 2, generator=gen)[
        : k - 4] + 1])
    idx = idx[torch.randperm(k, generator=gen)].unique()
    k = idx.numel()
    vals = torch.randn(k, generator=gen) * 10
    packed = pack(quantize(vals, "compact"), idx, N, "compact")
    assert packed.dtype == torch.uint8
    assert packed.numel() == payload_nbytes(k, N, "compact") == 4 * k + 4 * index_blocks(N) == 4 * k + 16
    got_vals, got_idx = unpack(packed, k, N, "compact")
    order = got_idx.argsort()
    ref = idx.argsort()
    assert torch.equal(got_idx[order], idx[ref])
    assert torch.allclose(got_vals[order], vals[ref], rtol=FP16_EPS, atol=0)
    assert not torch.equal(got_vals[order], vals[ref])  # fp16 did round (the check can fail)
    # fp32 payload: exact, 8 bytes an entry
    p32 = pack(vals, idx, N, "fp32")
    assert p32.numel() * p32.element_size() == payload_nbytes(k, N, "fp32") == 8 * k
    v32, i32 = unpack(p32, k, N, "fp32")
    assert torch.equal(v32, vals) and torch.equal(i32, idx)


def test_compact_pack_refuses_an_index_past_the_chunk():
    # The block counts have a fixed length (no host read of the largest index): an index past the chunk is out of
    # their bounds, never a payload of another size.
    with pytest.raises(RuntimeError, match="out of bounds"):
        pack(torch.ones(2), torch.tensor([0, INDEX_BLOCK + 5]), INDEX_BLOCK, "compact")


@pytest.mark.parametrize("selection", ["exact", "sampled"])
def test_residual_keeps_the_fp16_rounding_error_so_sent_plus_residual_is_the_accumulated_value(selection):
    hook = CommHook(CommConfig(mode="topk", ratio=0.01, warmup_steps=0, payload="compact", selection=selection),
                    Topology.simulated(2, 0, 1), torch.device("cpu"))
    acc0 = _values(N, 1)
    residual = acc0.clone()  # as in the hook: the residual is the accumulator, updated in place
    packed, k = hook.sparse.sparsify(residual, residual)
    assert packed.numel() == payload_nbytes(k, N, "compact")
    sent = scatter_sum([packed], k, N, "compact", torch.device("cpu"))
    assert torch.equal(sent + residual, acc0)  # bit for bit in fp32: nothing was lost
    idx = sent.nonzero().squeeze(1)
    assert idx.numel() == k
    err = residual[idx]
    assert (err != 0).sum() > k // 2  # most sent values did round, and their error stayed behind
    assert (err.abs() <= acc0[idx].abs() * FP16_EPS).all() or bool((acc0[idx].abs() > FP16_MAX).any())
    big = acc0.abs() > FP16_MAX
    assert torch.equal(sent[big].abs(), torch.full((int(big.sum()),), FP16_MAX))  # clamped, the rest kept
    # the fp32 payload sends the value itself and zeroes the residual there
    h32 = CommHook(CommConfig(mode="topk", ratio=0.01, warmup_steps=0, payload="fp32", selection=selection),
                   Topology.simulated(2, 0, 1), torch.device("cpu"))
    r32 = acc0.clone()
    p32, k32 = h32.sparse.sparsify(r32, r32)
    s32 = scatter_sum([p32], k32, N, "fp32", torch.device("cpu"))
    assert torch.equal(s32 + r32, acc0) and bool((r32[s32 != 0] == 0).all())


# --- 2 gloo ranks ----------------------------------------------------------------------------------
def _worker(rank: int, world: int, folder: str) -> None:
    from bench.comm import _Handed

    handed = _Handed()  # wraps torch.distributed's all_reduce / all_gather until the rank pool puts them back
    out: dict = {}
    for mode, per_node in (("topk", 2), ("hierarchical_topk", 1)):  # hierarchical: 2 simulated nodes of 1
        topo = Topology.simulated(world, rank, per_node)
        for payload in ("compact", "fp32"):
            hook = CommHook(CommConfig(mode=mode, ratio=0.01, warmup_steps=0, payload=payload), topo,
                            torch.device("cpu"))
            hook.prepare()
            handed.names = hook.groups.named() if hook.groups is not None else {}
            before, by0 = handed.bytes, dict(handed.by_group)
            res = []
            for step in range(2):
                res.append(hook.aggregate(_values(N, 10 * step + rank, extremes=False), [("w", N)]))
            out[(mode, payload)] = {"out": res, "residual": hook.residuals()["w"], "handed": handed.bytes - before,
                                    "by_group": {g: v - by0.get(g, 0) for g, v in handed.by_group.items()},
                                    "meter": hook.bytes_sent, "inter": hook.bytes_inter_node}
    torch.save(out, os.path.join(folder, f"out{rank}.pt"))


@pytest.fixture(scope="module")
def gloo(tmp_path_factory) -> list[dict]:
    return spawn_ranks(_worker, 2, tmp_path_factory.mktemp("payload"))


@pytest.mark.parametrize("mode", ["topk", "hierarchical_topk"])
def test_compact_gather_on_two_gloo_ranks_equals_the_fp32_payload_within_fp16_rounding(gloo, mode):
    for r in range(2):
        compact, fp32 = gloo[r][(mode, "compact")], gloo[r][(mode, "fp32")]
        # the first step sends the same entries either way (the residuals start at zero): fp16 rounding apart
        a, b = compact["out"][0], fp32["out"][0]
        assert torch.equal(a != 0, b != 0)
        # each rank's value rounded by at most FP16_EPS of itself, then the two averaged
        bound = FP16_EPS * (_values(N, 0, False).abs() + _values(N, 1, False).abs()) / 2
        assert bool(((a - b).abs() <= bound).all())
        assert not torch.equal(a, b)
        assert torch.equal(gloo[0][(mode, "compact")]["out"][1], gloo[1][(mode, "compact")]["out"][1])  # replicas


@pytest.mark.parametrize("mode", ["topk", "hierarchical_topk"])
def test_compact_payload_halves_the_bytes_handed_to_the_all_gather(gloo, mode):
    group = "world" if mode == "topk" else "cross_node"
    compact, fp32 = gloo[0][(mode, "compact")], gloo[0][(mode, "fp32")]
    k = -(-N // 100)  # hierarchical: one worker per node, so its chunk is the whole bucket
    agree = 4 * 8 if group == "world" else 0  # the hook's first-bucket agreement all-reduce (4 int64)
    sparse_c, sparse_f = compact["by_group"][group] - agree, fp32["by_group"][group] - agree
    assert sparse_f == 2 * 8 * k  # two steps of k fp32 values + k int32 indices
    assert sparse_c == 2 * (4 * k + 4 * index_blocks(N))
    assert sparse_c / sparse_f < 0.51
    meter = "meter" if mode == "topk" else "inter"  # flat top-k here: one node, nothing crosses
    assert compact[meter] / fp32[meter] < 0.51  # the hook's meter agrees
