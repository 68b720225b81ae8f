"""bench/gpu_throughput.py's comparators: plain PyTorch done right sets what lightray sets (TF32, the fused SGD
kernel, cuDNN's benchmark) by hand, so the ratio measures lightray's units and nothing it merely switches on.
The settings are checked for a CUDA device object (they are flags and constructor choices; no GPU is needed)."""

from __future__ import annotations

import argparse

import pytest
import torch

from bench.gpu_throughput import _optimizer, _variant_configs

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _keep_backend_flags():
    saved = (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    yield
    torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _flags_after(name: str) -> tuple[bool, bool, bool]:
    _variant_configs(name, argparse.Namespace(arch="resnet_tiny"), CUDA)
    return torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def test_plain_done_right_turns_on_the_tf32_and_cudnn_benchmark_lightray_turns_on():
    assert _flags_after("plain_bf16") == _flags_after("lightray") == (True, True, True)
    assert _flags_after("plain_bf16_compile") == _flags_after("lightray_compile")
    assert _flags_after("plain") == (False, False, True)  # the out-of-the-box baseline: torch's defaults


def test_plain_done_right_steps_with_the_fused_sgd_kernel_and_the_baseline_with_torchs_default():
    model = torch.nn.Linear(4, 2)
    _, ocfg, plain = _variant_configs("plain_bf16", argparse.Namespace(arch="resnet_tiny"), CUDA)
    assert plain and ocfg.fused is False  # the plain side does not go through lightray's optimiser config
    assert _optimizer(model, ocfg, plain, torch.device("cpu"), fused=True).defaults["fused"] is True
    assert not _optimizer(model, ocfg, plain, torch.device("cpu")).defaults.get("fused")
