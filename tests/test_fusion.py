"""Adaptive gradient fusion: the alpha-beta fit, the bucket rule, and the measurement on real gloo."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightray.comm.fusion import (
    MB,
    TORCH_DEFAULT_MB,
    choose_bucket_mb,
    exposed_cost,
    fit_alpha_beta,
    gradient_bytes,
    optimal_bucket_mb,
)


def test_fit_recovers_latency_and_inverse_bandwidth():
    alpha, beta = 2e-4, 1 / 3.125e9  # 200 us, 25 Gbps
    sizes = [64e3, 256e3, 1e6, 4e6, 16e6]
    a, b = fit_alpha_beta(sizes, [alpha + beta * s for s in sizes])
    assert a == pytest.approx(alpha, rel=1e-6)
    assert b == pytest.approx(beta, rel=1e-6)


def test_fit_rejects_a_single_message_size():
    with pytest.raises(ValueError, match="different message sizes"):
        fit_alpha_beta([1e6, 1e6], [1e-3, 2e-3])


def test_bucket_grows_with_latency_and_follows_the_square_root_rule():
    grad = 100 * MB
    beta = 1 / 3.125e9
    small = optimal_bucket_mb(grad, 1e-5, beta)
    large = optimal_bucket_mb(grad, 4e-3, beta)
    assert small < large
    assert large == pytest.approx(math.sqrt(grad * 4e-3 / beta) / MB, rel=0.05)


def test_bucket_is_clamped_to_the_gradient_size_and_the_floor():
    assert optimal_bucket_mb(3 * MB, 1.0, 1e-12) == 3.0  # huge latency: one bucket holds everything
    assert optimal_bucket_mb(100 * MB, 1e-9, 1e-6, min_mb=1.0) == 1.0


def test_chosen_bucket_minimises_the_modelled_exposed_cost():
    grad, alpha, beta = 100 * MB, 7.6e-3, 0.64e-9
    best = optimal_bucket_mb(grad, alpha, beta) * MB
    for other_mb in (1, 4, 10, TORCH_DEFAULT_MB, 100):
        assert exposed_cost(best, grad, alpha, beta) <= exposed_cost(other_mb * MB, grad, alpha, beta) * 1.02


def test_pinned_size_is_returned_without_measuring():
    model = torch.nn.Linear(10, 10)
    mb, ev = choose_bucket_mb(model, 8, torch.device("cpu"), pinned_mb=12.5)
    assert mb == 12.5 and ev["pinned"] is True


def test_single_worker_keeps_torch_default():
    mb, ev = choose_bucket_mb(torch.nn.Linear(10, 10), 1, torch.device("cpu"))
    assert mb == TORCH_DEFAULT_MB and "single worker" in ev["reason"]


def _measure_worker(rank: int, world: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))  # 8 MB of fp32 grads
    mb, ev = choose_bucket_mb(model, world, torch.device("cpu"), max_mb=4.0, repeats=2)
    # The choice plugs into DDP and a step runs with it.
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=mb)
    ddp(torch.randn(2, 1024)).sum().backward()
    torch.save({"mb": mb, "ev": ev, "grad": gradient_bytes(model)}, os.path.join(folder, f"out{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown: ~20 s per process on a loaded 2-core machine


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("fusion")
    mp.spawn(_measure_worker, args=(2, str(folder)), nprocs=2, join=True)
    return [torch.load(folder / f"out{r}.pt", weights_only=False) for r in range(2)]


def test_measured_choice_is_identical_on_every_rank(measured):
    assert measured[0]["mb"] == measured[1]["mb"]
    assert measured[0]["ev"]["allreduce_s"] == measured[1]["ev"]["allreduce_s"]


def test_measured_choice_lies_in_bounds_and_carries_its_evidence(measured):
    d = measured[0]
    ev = d["ev"]
    assert 1.0 <= d["mb"] <= d["grad"] / MB
    assert ev["pinned"] is False and ev["alpha_s"] > 0 and ev["beta_s_per_byte"] > 0
    assert len(ev["sizes_bytes"]) == len(ev["allreduce_s"]) >= 2
    assert ev["sizes_bytes"][-1] <= 4 * MB
    assert ev["modelled_exposed_s"]["chosen"] <= ev["modelled_exposed_s"]["torch_default_25mb"] * 1.02
