"""Models, zero-init, channels_last, EMA through wrappers, and the device units on CPU."""

from __future__ import annotations

import json
import math
import os
import pathlib
import random
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from PIL import Image, ImageDraw
from torch import nn

from lightray.config import ConfigError, ModelConfig, OptimConfig
from lightray.schedule import Schedule
from lightray.train import device as dev
from lightray.train.ema import ModelEMA
from lightray.train.model import build_model, residual_last_bns, to_device, unwrap_model
from lightray.train.optim import build_loss, build_optimizer, set_lr_momentum
from lightray.units import pop_unit_events

CPU = torch.device("cpu")
ROOT = pathlib.Path(__file__).resolve().parents[1]


# --- architectures --------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,blocks,lo,hi", [("resnet_tiny", 3, 0.3e6, 1e6), ("resnet18", 8, 11e6, 12e6),
                                               ("resnet50", 16, 23e6, 26e6)])
def test_build_model_arch_size_and_output(arch, blocks, lo, hi):
    model = build_model(ModelConfig(arch=arch), num_classes=7)
    assert lo <= sum(p.numel() for p in model.parameters()) <= hi
    assert len(residual_last_bns(model)) == blocks
    model.eval()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_unknown_arch_is_a_clear_error():
    with pytest.raises(ValueError, match="model.arch: bad value 'vgg'"):
        build_model(ModelConfig(arch="vgg"), 10)


@pytest.mark.parametrize("arch", ["resnet_tiny", "resnet18", "resnet50"])
def test_zero_init_residual_zeroes_last_bn_gamma_and_off_keeps_ones(arch):
    on = residual_last_bns(build_model(ModelConfig(arch=arch, zero_init_residual=True), 10))
    off = residual_last_bns(build_model(ModelConfig(arch=arch, zero_init_residual=False), 10))
    assert all(torch.count_nonzero(bn.weight) == 0 for bn in on)
    assert all(bool((bn.weight != 0).all()) for bn in off)


def test_zero_init_makes_each_block_ignore_its_residual_branch():
    """With the last gamma at 0 a block's output does not depend on its convolutions' weights."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    for zero, should_change in ((True, False), (False, True)):
        model = build_model(ModelConfig(arch="resnet_tiny", zero_init_residual=zero), 10).eval()
        before = model(x)
        with torch.no_grad():
            model.stages[0][0].conv1.weight.normal_()
        assert (not torch.allclose(model(x), before)) == should_change


# --- channels_last ---------------------------------------------------------------------------------------
def test_channels_last_moves_weights_and_keeps_outputs():
    torch.manual_seed(0)
    plain_cfg, cl_cfg = ModelConfig(channels_last=False), ModelConfig(channels_last=True)
    base = build_model(plain_cfg, 10).eval()
    plain = to_device(base, CPU, plain_cfg)
    cl = to_device(build_model(cl_cfg, 10).eval(), CPU, cl_cfg)
    cl.load_state_dict(plain.state_dict())
    assert cl.stem[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert not plain.stem[0].weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(cl(x.contiguous(memory_format=torch.channels_last)), plain(x), rtol=1e-4, atol=1e-5)


def test_images_to_device_normalizes_and_lays_out():
    img = torch.randint(0, 256, (2, 8, 8, 3), dtype=torch.uint8)
    out = dev.images_to_device(img, CPU, channels_last=True)
    assert out.shape == (2, 3, 8, 8) and out.dtype == torch.float32
    assert out.is_contiguous(memory_format=torch.channels_last)
    expect = (img[1, 4, 5, 2].item() / 255.0 - dev.IMAGENET_MEAN[2]) / dev.IMAGENET_STD[2]
    assert out[1, 2, 4, 5].item() == pytest.approx(expect, rel=1e-5)
    plain = dev.images_to_device(img, CPU, channels_last=False)
    assert plain.is_contiguous()
    torch.testing.assert_close(plain, out)
    with pytest.raises(ValueError, match="expected torch.uint8"):
        dev.images_to_device(img.float(), CPU, channels_last=False)


# --- device units on CPU -------------------------------------------------------------------------------------
def test_cpu_device_units_fall_back_to_plain_and_say_so():
    pop_unit_events()
    device = dev.select_device()
    assert device == CPU and dev.backend_for(device) == "gloo"
    assert dev.backend_for(torch.device("cuda", 0)) == "nccl"
    assert dev.precision_for(ModelConfig(precision="auto"), device) == ("bf16" if dev.cpu_bf16_flags() else "fp32")
    assert dev.precision_for(ModelConfig(precision="fp32"), device) == "fp32"
    assert dev.precision_for(ModelConfig(precision="bf16"), device) == "bf16"
    assert not dev.make_grad_scaler("fp32", device).is_enabled()
    assert dev.enable_cudnn_benchmark(ModelConfig(), device) is False
    model = nn.Linear(4, 2)
    assert dev.maybe_compile(model, ModelConfig(compile=True), device) is model
    assert dev.maybe_compile(model, ModelConfig(compile=False), device) is model
    # Asked for on the CPU: compiled behind the shape policy (torch.compile is lazy: nothing compiles here).
    forced = dev.maybe_compile(model, ModelConfig(compile=True, compile_on_cpu=True), device)
    assert isinstance(forced, dev.CompiledForward) and dev.unwrap_model(forced) is model
    said: dict[str, list[str]] = {}
    for e in pop_unit_events():
        said.setdefault(e["unit"], []).append(e["message"])
    assert {"device", "precision", "grad_scaler", "cudnn_benchmark", "compile"} <= set(said)
    assert "not applicable on cpu" in said["compile"][0]
    assert "off (model.compile=false)" in said["compile"][1]
    assert "torch.compile on cpu" in said["compile"][2] and "batch dimension dynamic" in said["compile"][2]


def test_auto_precision_on_cpu_is_bf16_exactly_where_the_cpu_has_bf16_in_hardware(tmp_path):
    # This machine's own /proc/cpuinfo decides what auto picks here, and the unit line says why.
    flags = open("/proc/cpuinfo").read().split()
    native = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    assert dev.cpu_bf16_flags() == native
    pop_unit_events()
    assert dev.precision_for(ModelConfig(precision="auto"), CPU) == ("bf16" if native else "fp32")
    said = [e["message"] for e in pop_unit_events() if e["unit"] == "precision"]
    assert said and ("the CPU has " + ", ".join(native) if native else "the CPU has none of") in said[0]
    # The flag reader on other CPUs' flag lines: an AVX2-only CPU, a Sapphire Rapids, and no cpuinfo at all.
    avx2 = tmp_path / "avx2"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    spr = tmp_path / "spr"
    spr.write_text("processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert dev.cpu_bf16_flags(str(avx2)) == []
    assert dev.cpu_bf16_flags(str(spr)) == ["avx512_bf16", "amx_bf16"]
    assert dev.cpu_bf16_flags(str(tmp_path / "absent")) == []


def test_fp16_on_cpu_is_a_config_error():
    with pytest.raises(ConfigError, match="model.precision: bad value 'fp16' on cpu"):
        dev.precision_for(ModelConfig(precision="fp16"), CPU)


def test_autocast_bf16_changes_compute_dtype_and_fp32_does_not():
    lin, x = nn.Linear(4, 3), torch.randn(2, 4)
    with dev.autocast("bf16", CPU):
        assert lin(x).dtype == torch.bfloat16
    with dev.autocast("fp32", CPU):
        assert lin(x).dtype == torch.float32


# --- wrappers: DDP on a real gloo group ------------------------------------------------------------------------
def test_unwrap_and_ema_see_through_ddp(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        inner = build_model(ModelConfig(), 10)
        ddp = nn.parallel.DistributedDataParallel(inner)
        assert unwrap_model(ddp) is inner
        ema = ModelEMA(ddp, decay=0.5)
        assert set(ema.module.state_dict()) == set(inner.state_dict())  # no "module." prefix
        ddp(torch.randn(4, 3, 32, 32)).sum().backward()
        ema.update(ddp)
        torch.testing.assert_close(ema.module.stem[1].running_mean, inner.stem[1].running_mean)
    finally:
        dist.destroy_process_group()


# --- the tiny model learns shapes ------------------------------------------------------------------------------
def draw_shape(kind: int, rng: random.Random, size: int) -> Image.Image:
    bg = tuple(rng.randint(0, 90) for _ in range(3))
    fg = tuple(rng.randint(140, 255) for _ in range(3))
    im = Image.new("RGB", (size, size), bg)
    d = ImageDraw.Draw(im)
    r = rng.uniform(0.25, 0.4) * size
    cx, cy = rng.uniform(r, size - r), rng.uniform(r, size - r)
    box = (cx - r, cy - r, cx + r, cy + r)
    w = max(2, int(r / 3))
    if kind == 0:
        d.ellipse(box, fill=fg)
    elif kind == 1:
        d.rectangle(box, fill=fg)
    elif kind == 2:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fg)
    elif kind == 3:
        d.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fg)
    elif kind == 4:
        d.ellipse(box, outline=fg, width=w)
    elif kind == 5:
        d.rectangle(box, outline=fg, width=w)
    elif kind == 6:
        d.rectangle((cx - r, cy - w, cx + r, cy + w), fill=fg)
        d.rectangle((cx - w, cy - r, cx + w, cy + r), fill=fg)
    elif kind == 7:
        d.line((cx - r, cy - r, cx + r, cy + r), fill=fg, width=w)
        d.line((cx - r, cy + r, cx + r, cy - r), fill=fg, width=w)
    elif kind == 8:
        d.rectangle((cx - r, cy - w, cx + r, cy + w), fill=fg)
    else:
        d.rectangle((cx - w, cy - r, cx + w, cy + r), fill=fg)
    return im


def shapes(n_per_class: int, seed: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    rng = random.Random(seed)
    imgs, labels = [], []
    for i in range(n_per_class * 10):
        imgs.append(torch.frombuffer(bytearray(draw_shape(i % 10, rng, size).tobytes()), dtype=torch.uint8))
        labels.append(i % 10)
    return torch.stack(imgs).view(-1, size, size, 3), torch.tensor(labels)


@pytest.mark.slow
@pytest.mark.shares_cpu
def test_tiny_resnet_learns_ten_shapes_above_80_percent():
    """The demo's model with the real units (zero-init, channels_last, no-BN-decay SGD, label smoothing,
    the schedule's warm-up + linear decay) reaches > 80% on held-out synthetic shapes."""
    torch.manual_seed(0)
    x_train, y_train = shapes(150, seed=1)
    x_val, y_val = shapes(30, seed=2)
    mcfg = ModelConfig(arch="resnet_tiny")
    ocfg = OptimConfig(lr_per_256=0.4, weight_decay=5e-5, label_smoothing=0.1)
    from lightray.config import Phase, ScheduleConfig

    batch = 64
    sched = Schedule(ScheduleConfig(epochs=6, warmup_epochs=1, decay="linear", phases=[Phase(6, 32, batch)]),
                     ocfg, len(y_train))
    model = to_device(build_model(mcfg, 10), CPU, mcfg)
    opt, loss_fn = build_optimizer(model, ocfg, CPU), build_loss(ocfg)
    seen = 0
    g = torch.Generator().manual_seed(0)
    for epoch in range(sched.epochs):
        model.train()
        order = torch.randperm(len(y_train), generator=g)
        for s in range(sched.steps_in_epoch(epoch)):
            idx = order[s * batch:(s + 1) * batch]
            flip = torch.rand(len(idx), generator=g) < 0.5
            imgs = x_train[idx]
            imgs[flip] = imgs[flip].flip(2)
            set_lr_momentum(opt, sched.lr_at(seen), sched.momentum_at(seen))
            loss = loss_fn(model(dev.images_to_device(imgs, CPU, True)), y_train[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += batch
    model.eval()
    with torch.no_grad():
        acc = (model(dev.images_to_device(x_val, CPU, True)).argmax(1) == y_val).float().mean().item()
    assert math.isfinite(loss.item())
    print(f"val accuracy {acc:.3f}")
    assert acc > 0.8, f"val accuracy {acc:.3f}"


# --- bench/gpu_check.sh dry run --------------------------------------------------------------------------------
# Stays in CI: the only run of bench.gpu_throughput's compiled variant (the GPU suite's dry run times eager only).
@pytest.mark.slow
@pytest.mark.shares_cpu
def test_gpu_check_cpu_dry_run_prints_bench_json():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--cpu-dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip().splitlines()[-1]
    out = json.loads(line)
    assert out["bench"] == "gpu_check"
    figs = out["figures"]
    for key in ("plain_img_s", "lightray_img_s", "lightray_compile_img_s"):
        assert figs[key] > 0
    assert out["ratios"]["lightray_over_plain"] > 0
    assert out["machine"]["device"] == "cpu" and out["machine"]["dry_run"] is True
    assert sys.version.split()[0] in out["machine"]["python"]


def test_the_worker_code_of_a_lightray_model_loads_without_torchvision_or_dynamo():
    """A Train worker and the driver import the worker code at every start; torchvision (and torch._dynamo,
    which torchvision.ops pulls in) cost each about 2 s there, for a model that needs neither."""
    probe = ("import sys, json, lightray.train.worker, lightray.report.summary as s; v = s.versions(); "
             "loaded = [m for m in ('torchvision', 'torch._dynamo') if m in sys.modules]; "
             "print(json.dumps(loaded + [v['torchvision']]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    import torchvision

    assert json.loads(out.stdout.strip().splitlines()[-1]) == [torchvision.__version__]


def test_the_tiny_resnets_basic_block_is_torchvisions_in_names_and_outputs():
    from torchvision.models.resnet import BasicBlock as TorchvisionBlock

    from lightray.train.model import BasicBlock

    torch.manual_seed(0)
    down = nn.Sequential(nn.Conv2d(8, 16, 1, stride=2, bias=False), nn.BatchNorm2d(16))
    ours, theirs = BasicBlock(8, 16, stride=2, downsample=down), TorchvisionBlock(8, 16, stride=2, downsample=down)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 8, 12, 12)
    torch.testing.assert_close(ours.eval()(x), theirs.eval()(x), rtol=0, atol=0)
    # zero_init_residual finds both kinds of block
    assert residual_last_bns(nn.Sequential(ours, theirs)) == [ours.bn2, theirs.bn2]
