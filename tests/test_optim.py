"""Optimisers, parameter groups, loss and EMA against their published formulas on small tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightray.config import ModelConfig, OptimConfig
from lightray.train.ema import ModelEMA, maybe_ema
from lightray.train.model import build_model
from lightray.train.optim import (
    build_loss,
    build_optimizer,
    clip_gradients,
    param_groups,
    set_lr_momentum,
)
from lightray.units import pop_unit_events

CPU = torch.device("cpu")


class Small(nn.Module):
    """conv (decay) -> BN (no decay) -> linear with bias (weight decays, bias does not)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, bias=False)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(12, 4)

    def forward(self, x):
        return self.fc(torch.flatten(F.relu(self.bn(self.conv(x))), 1))


def small(seed: int = 0) -> Small:
    torch.manual_seed(seed)
    m = Small().double()
    with torch.no_grad():  # non-trivial BN params so their updates are visible
        m.bn.weight.uniform_(0.5, 1.5)
        m.bn.bias.uniform_(-0.5, 0.5)
    return m


def set_grads(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


DECAYED = {"conv.weight", "fc.weight"}


# --- parameter groups -------------------------------------------------------------------------------
def test_bn_and_bias_are_excluded_from_weight_decay():
    model = build_model(ModelConfig(arch="resnet_tiny"), 10)
    groups = {g["name"]: g for g in param_groups(model, OptimConfig(weight_decay=1e-4))}
    decay_ids = {id(p) for p in groups["decay"]["params"]}
    bn_ids = {id(p) for m in model.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()}
    assert groups["no_decay"]["weight_decay"] == 0.0 and groups["decay"]["weight_decay"] == 1e-4
    assert bn_ids and not bn_ids & decay_ids
    assert id(model.fc.bias) not in decay_ids
    assert id(model.fc.weight) in decay_ids
    convs = [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert all(id(w) in decay_ids for w in convs)
    n_all = sum(1 for _ in model.parameters())
    assert sum(len(g["params"]) for g in groups.values()) == n_all  # every parameter exactly once


def test_bn_bias_decay_on_decays_everything():
    model = small()
    groups = param_groups(model, OptimConfig(weight_decay=1e-4, bn_bias_decay=True))
    assert all(g["weight_decay"] == 1e-4 for g in groups)


@pytest.mark.parametrize("bn_bias_decay", [False, True])
def test_sgd_step_with_zero_gradient_shrinks_only_decayed_params(bn_bias_decay):
    model = small()
    cfg = OptimConfig(name="sgd", weight_decay=0.1, momentum=0.0, nesterov=False, bn_bias_decay=bn_bias_decay)
    opt = build_optimizer(model, cfg, CPU)
    set_lr_momentum(opt, 0.5, 0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    before = snapshot(model)
    opt.step()
    for name, p in model.named_parameters():
        decays = name in DECAYED or bn_bias_decay
        expect = before[name] * (1 - 0.5 * 0.1) if decays else before[name]
        torch.testing.assert_close(p.detach(), expect, msg=name)


# --- SGD + Nesterov -------------------------------------------------------------------------------------
@pytest.mark.parametrize("fused", [True, False])
def test_sgd_nesterov_two_steps_match_formula(fused):
    """torch's Nesterov form: g' = g + wd w; b = m b + g'; w -= lr (g' + m b); b_1 = g'_1."""
    lr, m, wd = 0.3, 0.9, 0.01
    model = small()
    opt = build_optimizer(model, OptimConfig(name="sgd", weight_decay=wd, nesterov=True, fused=fused), CPU)
    ref = snapshot(model)
    bufs: dict[str, torch.Tensor] = {}
    for step in range(2):
        set_grads(model, seed=step)
        set_lr_momentum(opt, lr, m)
        for name, p in model.named_parameters():
            g = p.grad + (wd * ref[name] if name in DECAYED else 0)
            bufs[name] = g.clone() if step == 0 else m * bufs[name] + g
            ref[name] = ref[name] - lr * (g + m * bufs[name])
        opt.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref[name], msg=name)


# --- LARS (You, Gitman, Ginsburg 2017, Algorithm 1) -------------------------------------------------------
@pytest.mark.parametrize("fused", [True, False])
def test_lars_two_steps_match_published_update(fused):
    """local_lr = eta ||w|| / (||g|| + beta ||w||); v = m v + lr * local_lr * (g + beta w); w -= v.
    BN and bias are excluded from adaptation and decay: plain momentum SGD for them."""
    lr, m, wd, eta = 0.5, 0.9, 5e-4, 0.02
    model = small()
    cfg = OptimConfig(name="lars", weight_decay=wd, trust_coefficient=eta, nesterov=False, lars_eps=0.0,
                      fused=fused)
    opt = build_optimizer(model, cfg, CPU)
    ref = snapshot(model)
    v: dict[str, torch.Tensor] = {}
    for step in range(2):
        set_grads(model, seed=10 + step)
        set_lr_momentum(opt, lr, m)
        for name, p in model.named_parameters():
            w, g = ref[name], p.grad
            if name in DECAYED:
                local = eta * w.norm() / (g.norm() + wd * w.norm())
                upd = lr * local * (g + wd * w)
            else:
                upd = lr * g
            v[name] = upd if step == 0 else m * v[name] + upd
            ref[name] = w - v[name]
        opt.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref[name], msg=name)


def test_lars_adapts_decayed_weights_even_at_zero_weight_decay():
    model = small()
    opt = build_optimizer(model, OptimConfig(name="lars", weight_decay=0.0, trust_coefficient=0.001,
                                             momentum=0.0, nesterov=False), CPU)
    set_grads(model, seed=3)
    set_lr_momentum(opt, 1.0, 0.0)
    w0, g = model.conv.weight.detach().clone(), model.conv.weight.grad.clone()
    opt.step()
    step = w0 - model.conv.weight.detach()
    torch.testing.assert_close(step, 0.001 * w0.norm() / g.norm() * g, rtol=1e-5, atol=1e-9)


# --- LAMB (You et al. 2019, Algorithm 2) ----------------------------------------------------------------
@pytest.mark.parametrize("fused", [True, False])
def test_lamb_two_steps_match_published_update(fused):
    """m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; r = m_hat / (sqrt(v_hat) + eps);
    w -= lr * ||w|| / ||r + wd w|| * (r + wd w). BN/bias: no decay, no trust ratio (Adam step)."""
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.999, 1e-6, 0.01
    model = small()
    cfg = OptimConfig(name="lamb", weight_decay=wd, momentum=b1, lamb_beta2=b2, lamb_eps=eps, fused=fused)
    opt = build_optimizer(model, cfg, CPU)
    ref = snapshot(model)
    mom = {n: torch.zeros_like(p) for n, p in ref.items()}
    var = {n: torch.zeros_like(p) for n, p in ref.items()}
    for t in (1, 2):
        set_grads(model, seed=20 + t)
        set_lr_momentum(opt, lr, b1)
        for name, p in model.named_parameters():
            g, w = p.grad, ref[name]
            mom[name] = b1 * mom[name] + (1 - b1) * g
            var[name] = b2 * var[name] + (1 - b2) * g * g
            r = (mom[name] / (1 - b1**t)) / ((var[name] / (1 - b2**t)).sqrt() + eps)
            if name in DECAYED:
                u = r + wd * w
                ref[name] = w - lr * w.norm() / u.norm() * u
            else:
                ref[name] = w - lr * r
        opt.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref[name], msg=name)


def test_set_lr_momentum_reaches_every_group():
    model = small()
    for name in ("sgd", "lars", "lamb"):
        opt = build_optimizer(model, OptimConfig(name=name), CPU)
        set_lr_momentum(opt, 0.123, 0.8)
        for g in opt.param_groups:
            assert g["lr"] == 0.123
            assert (g["betas"][0] if name == "lamb" else g["momentum"]) == 0.8


def test_optimizer_choice_is_logged_as_a_unit():
    pop_unit_events()
    build_optimizer(small(), OptimConfig(name="lars"), CPU)
    units = {e["unit"]: e for e in pop_unit_events()}
    assert "LARS" in units["optimizer"]["message"]
    assert units["bn_bias_decay"]["excluded"] == 3 + 3 + 4  # bn.weight, bn.bias, fc.bias elements


# --- loss ---------------------------------------------------------------------------------------------
def test_label_smoothing_matches_formula():
    torch.manual_seed(0)
    logits, target, eps = torch.randn(6, 5, dtype=torch.float64), torch.tensor([0, 1, 4, 2, 2, 3]), 0.1
    logp = logits.log_softmax(1)
    expect = ((1 - eps) * -logp[torch.arange(6), target] + eps * -logp.mean(1)).mean()
    got = build_loss(OptimConfig(label_smoothing=eps))(logits, target)
    torch.testing.assert_close(got, expect)


def test_label_smoothing_off_is_plain_cross_entropy():
    torch.manual_seed(0)
    logits, target = torch.randn(4, 3), torch.tensor([0, 2, 1, 1])
    got = build_loss(OptimConfig(label_smoothing=0.0))(logits, target)
    torch.testing.assert_close(got, -logits.log_softmax(1)[torch.arange(4), target].mean())


# --- gradient clipping ------------------------------------------------------------------------------------
def test_grad_clip_bounds_global_norm_and_off_leaves_grads_and_keeps_the_norm_on_the_device():
    model = small()
    opt = build_optimizer(model, OptimConfig(), CPU)
    set_grads(model, seed=5)
    before = [p.grad.clone() for p in model.parameters()]
    assert clip_gradients(model, opt, OptimConfig(grad_clip=0.0)) is None
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
    norm = clip_gradients(model, opt, OptimConfig(grad_clip=0.5))
    # A tensor where the gradients are, not a float: a float would be a host sync on every GPU step.
    assert isinstance(norm, torch.Tensor) and norm.device == before[0].device and norm.dim() == 0
    assert norm.item() == pytest.approx(torch.cat([g.flatten() for g in before]).norm().item())
    assert torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item() == pytest.approx(0.5, rel=1e-4)


# --- EMA ----------------------------------------------------------------------------------------------
def test_ema_update_follows_formula_and_copies_buffers():
    model = small()
    ema = ModelEMA(model, decay=0.9)
    e0 = snapshot(ema.module)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.train()
    model(torch.randn(2, 2, 4, 4, dtype=torch.float64))  # moves BN running stats
    ema.update(model)
    for name, p in model.named_parameters():
        torch.testing.assert_close(dict(ema.module.named_parameters())[name], 0.9 * e0[name] + 0.1 * p.detach())
    torch.testing.assert_close(ema.module.bn.running_mean, model.bn.running_mean)
    torch.testing.assert_close(ema.module.bn.running_var, model.bn.running_var)
    assert ema.num_updates == 1


def test_ema_state_dict_round_trip():
    model = small()
    ema = ModelEMA(model, decay=0.5)
    with torch.no_grad():
        model.fc.weight.mul_(3)
    ema.update(model)
    other = ModelEMA(small(seed=1), decay=0.99)
    other.load_state_dict(ema.state_dict())
    assert other.decay == 0.5 and other.num_updates == 1
    torch.testing.assert_close(other.module.fc.weight, ema.module.fc.weight)


def test_ema_applied_to_swaps_weights_in_and_restores_them():
    model = small()
    ema = ModelEMA(model, decay=0.5)
    with torch.no_grad():
        model.fc.weight.add_(2.0)
    ema.update(model)  # ema fc = live - 1
    live = snapshot(model)
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    model.eval()
    ema.module.eval()
    with ema.applied_to(model) as m:
        torch.testing.assert_close(m(x), ema.module(x))
        assert not torch.equal(m.fc.weight, live["fc.weight"])
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), live[name])


def test_ema_off_gives_none():
    assert maybe_ema(small(), OptimConfig(ema_decay=0.0)) is None
    assert isinstance(maybe_ema(small(), OptimConfig(ema_decay=0.99)), ModelEMA)
