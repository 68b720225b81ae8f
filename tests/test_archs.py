"""Any torchvision or timm architecture: names are checked with close matches, and the model units
(zero-init of residual BN, channels_last) work on them or say that they do not apply."""

from __future__ import annotations

import pytest
import torch

from lightray.config import ConfigError, ModelConfig, load_config
from lightray.train import device as dev
from lightray.train.model import build_model, check_arch, to_device
from lightray.units import pop_unit_events
from tests.test_config import cli_in_process


@pytest.mark.parametrize("arch, close", [("resnet51", "resnet50"), ("timm:resnet10", "timm:resnet10t"),
                                         ("convnext_tinyy", "convnext_tiny")])
def test_unknown_arch_exits_2_with_close_matches(arch, close, capsys):
    code, err = cli_in_process(capsys, f"--model.arch={arch}", "--smoke-test", "--storage",
                               "/nonexistent-should-not-be-created")
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"model.arch: bad value {arch!r}" in lines[0]
    assert "close matches:" in lines[0] and close in lines[0].split("close matches:")[1]


def test_timm_and_torchvision_names_pass_the_config_check():
    assert load_config("smoke", {"model.arch": "timm:resnet10t"}).model.arch == "timm:resnet10t"
    assert check_arch("mobilenet_v3_small") == "torchvision" and check_arch("resnet_tiny") == "lightray"
    with pytest.raises(ConfigError, match="close matches: .*timm:resnet10t"):
        check_arch("timm:resnet10")


@pytest.mark.parametrize("zero", [True, False])
def test_timm_resnet_zero_init_follows_the_config(zero):
    model = build_model(ModelConfig(arch="timm:resnet10t", zero_init_residual=zero), 7)
    blocks = [m for m in model.modules() if callable(getattr(m, "zero_init_last", None))]
    assert len(blocks) == 4
    gammas = [b.bn2.weight for b in blocks]
    if zero:
        assert all(torch.count_nonzero(g) == 0 for g in gammas)
    else:
        assert all(bool((g != 0).all()) for g in gammas)


def test_a_model_without_residual_bn_says_zero_init_does_not_apply():
    pop_unit_events()
    model = build_model(ModelConfig(arch="timm:mobilenetv3_small_050", zero_init_residual=True), 5)
    events = {e["unit"]: e for e in pop_unit_events()}
    assert "not applicable to timm:mobilenetv3_small_050" in events["zero_init_residual"]["message"]
    model = to_device(model, torch.device("cpu"), ModelConfig(channels_last=True)).eval()
    x = dev.images_to_device(torch.zeros(2, 40, 40, 3, dtype=torch.uint8), torch.device("cpu"), True)
    assert model(x).shape == (2, 5)


def test_torchvision_arch_beyond_resnets_builds_with_the_class_count():
    model = build_model(ModelConfig(arch="mobilenet_v3_small"), 3).eval()
    assert model(torch.zeros(1, 3, 64, 64)).shape == (1, 3)


def test_cifar_vgg_is_airbench_shaped_for_32px_and_takes_its_widths():
    model = build_model(ModelConfig(arch="cifar_vgg", zero_init_residual=False), 10)
    assert sum(p.numel() for p in model.parameters()) == 1_972_792  # airbench94's widths 64/256/256
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(bns) == 6 and not any(bn.weight.requires_grad for bn in bns)  # scale-free BN, learned shift
    for res in (24, 32):
        assert model(torch.randn(2, 3, res, res)).shape == (2, 10)
    small = build_model(ModelConfig(arch="cifar_vgg", widths=[32, 128, 128], zero_init_residual=False), 10)
    assert [m.out_channels for m in small.modules() if isinstance(m, torch.nn.Conv2d)] == [24, 32, 32, 128, 128,
                                                                                           128, 128]
    conv = next(m for m in small.modules() if isinstance(m, torch.nn.Conv2d) and m.in_channels == 32
                and m.out_channels == 32)
    x = torch.randn(1, 32, 8, 8)
    assert torch.allclose(torch.nn.functional.conv2d(x, conv.weight, padding=1), x)  # identity init
    assert load_config("cifar10").model.arch == "cifar_vgg"
