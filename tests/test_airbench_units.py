"""The fast CIFAR-10 trainers' units (airbench94): translate, translated test-time views, the whitened stem, the
BN learning-rate factor and lookahead, each against a reference written out here from its definition."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lightray.config import ModelConfig, OptimConfig
from lightray.train.lookahead import Lookahead
from lightray.train.model import build_model
from lightray.train.optim import build_optimizer, set_lr_momentum
from lightray.train.shift import draw_shifts, shift_batch, shift_images, tta_logits
from lightray.train.whiten import EPS, whiten_from, whitening_stem


def test_each_image_moves_by_its_own_draw_with_reflected_edges_and_keeps_its_layout():
    x = torch.randn(64, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    ids = np.arange(1000, 1064)
    shifts = draw_shifts(7, 3, ids, 2)
    out = shift_batch(x, 7, 3, ids, 2)
    for i, (dy, dx) in enumerate(shifts):
        padded = np.pad(x[i].numpy(), ((0, 0), (2, 2), (2, 2)), mode="reflect")
        want = padded[:, 2 - dy:2 - dy + 8, 2 - dx:2 - dx + 8]  # content moves down by dy and right by dx
        np.testing.assert_array_equal(out[i].numpy(), want)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(shift_batch(x, 7, 3, ids, 0), x)


def test_shift_draws_depend_only_on_seed_epoch_and_sample_and_cover_every_offset():
    ids = np.arange(20_000)
    a = draw_shifts(0, 1, ids, 2)
    np.testing.assert_array_equal(a, draw_shifts(0, 1, ids, 2))
    np.testing.assert_array_equal(a[5000:5010], draw_shifts(0, 1, ids[5000:5010], 2))  # not the batch's order
    counts = np.bincount((a + 2).ravel(), minlength=5) / a.size
    assert counts.min() > 0.18 and counts.max() < 0.22  # uniform over -2..2: 0.2 each, +-0.003 at this size
    assert (a == draw_shifts(0, 2, ids, 2)).all(axis=1).mean() < 0.1  # another epoch: new draws (chance 0.04)
    assert (a == draw_shifts(1, 1, ids, 2)).all(axis=1).mean() < 0.1
    with pytest.raises(ValueError, match="data.translate"):
        draw_shifts(0, 1, ids, -1)


def test_translated_views_weigh_the_image_half_and_each_diagonal_move_a_quarter():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(5))
    x = torch.randn(6, 3, 12, 12)
    model(x)

    def mirrored(v):
        return (model(v) + model(v.flip(3))) / 2

    moved = [mirrored(shift_images(x, np.full((6, 2), d), 1)) for d in (1, -1)]
    want = 0.5 * mirrored(x) + 0.25 * (moved[0] + moved[1])
    torch.testing.assert_close(tta_logits(model, x, flip=True, translate=1), want)
    torch.testing.assert_close(tta_logits(model, x, flip=True, translate=0), mirrored(x))
    torch.testing.assert_close(tta_logits(model, x, flip=False, translate=0), model(x))


def test_whitened_stem_turns_correlated_patches_into_unit_variance_uncorrelated_features():
    model = build_model(ModelConfig(arch="cifar_vgg", widths=[16, 32, 32], whiten_stem=True,
                                    zero_init_residual=False), 10)
    stem = whitening_stem(model)
    assert not stem.weight.requires_grad and stem.bias.requires_grad
    # Smooth images: neighbouring pixels and channels strongly correlated, as in photos.
    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.avg_pool2d(torch.randn(256, 3, 36, 36, generator=g), 5, stride=1)
    x = x + 0.5 * x.mean(dim=1, keepdim=True)
    whiten_from(stem, x)
    w = stem.weight.detach()
    torch.testing.assert_close(w[12:], -w[:12])  # both signs of each direction
    feats = torch.nn.functional.conv2d(x, w[:12]).permute(0, 2, 3, 1).reshape(-1, 12).double()
    cov = feats.T @ feats / len(feats)
    # The reference: the patch covariance's eigenvalues, from NumPy's own windows. Direction k comes out with
    # variance lambda_k / (lambda_k + EPS): 1 where the data varies, damped where it is flat.
    win = np.lib.stride_tricks.sliding_window_view(x.numpy().astype(np.float64), (2, 2), axis=(2, 3))
    patches = win.transpose(0, 2, 3, 1, 4, 5).reshape(-1, 12)
    lam = np.linalg.eigvalsh(patches.T @ patches / len(patches))[::-1]
    np.testing.assert_allclose(torch.diagonal(cov).numpy(), lam / (lam + EPS), rtol=2e-3)
    assert (lam[:6] / (lam[:6] + EPS) > 0.95).all()  # the photo-like directions really come out at unit variance
    off = cov - torch.diag(torch.diagonal(cov))
    assert off.abs().max() < 1e-4  # decorrelated


def test_whiten_stem_on_a_model_without_a_whitening_stem_names_the_key():
    with pytest.raises(ValueError, match="model.whiten_stem.*cifar_vgg"):
        build_model(ModelConfig(arch="resnet_tiny", whiten_stem=True), 10)


def test_bn_lr_factor_moves_batchnorm_at_the_multiple_with_the_same_decay_per_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=True), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 36, 2))
    cfg = OptimConfig(lr_per_256=1.0, momentum=0.0, weight_decay=0.01, bn_bias_decay=True, bn_lr_factor=64.0,
                      fused=False)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    groups = {g["name"]: g for g in opt.param_groups}
    assert {id(p) for p in groups["bn"]["params"]} == {id(model[1].weight), id(model[1].bias)}
    set_lr_momentum(opt, 0.1, 0.0)
    assert groups["bn"]["lr"] == pytest.approx(6.4) and groups["decay"]["lr"] == pytest.approx(0.1)
    assert groups["no_decay"]["lr"] == pytest.approx(0.1)  # the conv's and linear's biases stay at the LR
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randn(8, 3, 8, 8)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    for name in ("1.weight", "1.bias"):  # p - lr * 64 * (g + wd / 64 * p): 64x the step, the same decay
        want = before[name] - 6.4 * grads[name] - 0.1 * 0.01 * before[name]
        torch.testing.assert_close(model.get_parameter(name).detach(), want)
    two = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    assert [g["name"] for g in two.param_groups] == ["decay", "no_decay"]  # off: the two groups of old checkpoints


def test_lookahead_pulls_towards_the_live_weights_on_airbench_schedule_and_hands_over_at_the_end():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    la = Lookahead(model, every=5)
    slow = [t.detach().clone() for t in la.slow]
    total = 20
    for step in range(1, total + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * step)  # stands in for an optimiser step
        model(torch.randn(4, 3))  # moves BN's running statistics, which the slow copy follows too
        live = [t.detach().clone() for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()]
        synced = la.after_step(model, step, step / total)
        assert synced == (step % 5 == 0)
        if synced:
            d = 0.95 ** 5 * (step / total) ** 3
            slow = [d * s + (1 - d) * v for s, v in zip(slow, live)]
            now = [t for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()]
            for s, t in zip(slow, now):
                torch.testing.assert_close(t.detach(), s)
    state = la.state_dict()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    la.finish(model)
    torch.testing.assert_close(model[0].weight.detach(), slow[0])
    other = Lookahead(model, every=5)
    other.load_state_dict(state)
    for a, b in zip(other.slow, la.slow):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="lookahead_every"):
        Lookahead(model, every=0)
