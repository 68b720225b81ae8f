"""app/schedule.py: phases, samples-seen positions, LR warm-up/decay shapes, momentum."""

from __future__ import annotations

import math

import pytest

from lightray.config import OptimConfig, Phase, ScheduleConfig
from lightray.schedule import Schedule, phase_ends, resolve, warmup_epochs

N = 1000  # training samples


def make(phases: list[Phase], epochs: int, **kw) -> Schedule:
    sched = ScheduleConfig(epochs=epochs, phases=phases, **kw)
    return Schedule(sched, OptimConfig(lr_per_256=0.4, momentum=0.9), N)


def base_lr(batch: int) -> float:
    return 0.4 * batch / 256


def test_epoch_runs_drop_last_steps_of_its_phase_batch():
    s = make([Phase(2, 32, 64), Phase(4, 64, 48)], 4, warmup_epochs=0, decay="none")
    assert [s.steps_in_epoch(e) for e in range(4)] == [N // 64] * 2 + [N // 48] * 2
    assert s.epoch_start(1) == (N // 64) * 64
    assert s.epoch_start(3) == 2 * (N // 64) * 64 + (N // 48) * 48
    assert s.total_samples == s.epoch_start(3) + (N // 48) * 48
    pos = s.locate(s.epoch_start(2) + 3 * 48)
    assert (pos.epoch, pos.step_in_epoch, pos.steps_in_epoch, pos.phase_index) == (2, 3, N // 48, 1)
    end = s.locate(s.total_samples)
    assert (end.epoch, end.step_in_epoch) == (3, N // 48)
    assert end.epoch_progress == pytest.approx(4.0)


def test_locate_rejects_samples_off_a_step_boundary():
    s = make([Phase(2, 32, 64)], 2, warmup_epochs=0, decay="none")
    with pytest.raises(ValueError, match="not on a step boundary"):
        s.locate(64 + 1)


def test_lr_is_rescaled_with_batch_when_phase_batch_changes():
    s = make([Phase(2, 32, 64), Phase(4, 64, 32)], 4, warmup_epochs=0, decay="none")
    before = s.lr_at(s.epoch_start(2) - 64)  # last step of epoch 1, batch 64
    after = s.lr_at(s.epoch_start(2))  # first step of epoch 2, batch 32
    assert before == pytest.approx(base_lr(64))
    assert after == pytest.approx(base_lr(32))
    assert after / before == pytest.approx(32 / 64)


def test_lr_is_continuous_across_a_phase_that_keeps_the_batch():
    s = make([Phase(2, 32, 50), Phase(4, 64, 50)], 4, warmup_epochs=0, decay="cosine")
    steps = s.steps_in_epoch(1)
    last = s.lr_at(s.epoch_start(2) - 50)
    first = s.lr_at(s.epoch_start(2))
    # One step moves the cosine by at most its max slope (pi/2 per span) times the step's share of an epoch.
    max_step_change = base_lr(50) * (math.pi / 2) / 4 / steps
    assert 0 < last - first <= max_step_change + 1e-12
    assert s.locate(s.epoch_start(2)).phase_index == 1


@pytest.mark.parametrize("batch", [40, 64])
def test_lr_depends_on_samples_seen_not_worker_count(batch):
    """The schedule takes no worker count: 1 worker stepping ``batch`` and 2 workers stepping ``batch / 2``
    each reach the same global samples-seen after every global step, so they see the same LR; an elastic
    resize from 1 to 2 workers mid-run continues the same curve."""
    s = make([Phase(3, 32, batch)], 3, warmup_epochs=1, decay="cosine", momentum_schedule=True)
    one_worker = []
    seen = 0
    while seen < s.total_samples:
        one_worker.append((s.locate(seen), s.lr_at(seen), s.momentum_at(seen)))
        seen += batch
    two_workers = []
    seen = 0
    per_worker = batch // 2
    while seen < s.total_samples:
        two_workers.append((s.locate(seen), s.lr_at(seen), s.momentum_at(seen)))
        seen += per_worker * 2  # the global count is the sum of both workers' local batches
    assert one_worker == two_workers
    # Resize after 5 steps: the second half picks up from samples_seen alone.
    resumed = one_worker[:5]
    seen = 5 * batch
    while seen < s.total_samples:
        resumed.append((s.locate(seen), s.lr_at(seen), s.momentum_at(seen)))
        seen += per_worker * 2
    assert resumed == one_worker
    lrs = [lr for _, lr, _ in one_worker]
    assert len(set(lrs)) > 5  # the curve really moves, so the equality above is not vacuous


def test_warmup_starts_at_start_factor_and_ends_at_peak():
    s = make([Phase(4, 32, 50)], 4, warmup_epochs=2, warmup_start_factor=0.1, decay="linear")
    assert s.lr_at(0) == pytest.approx(base_lr(50) * 0.1)
    assert s.lr_at(s.epoch_start(1)) == pytest.approx(base_lr(50) * (0.1 + 0.9 * 0.5))  # halfway
    assert s.lr_at(s.epoch_start(2)) == pytest.approx(base_lr(50))  # end of warm-up = peak
    assert s.lr_shape(2.0) == pytest.approx(1.0)
    assert s.lr_shape(2.0 - 1e-9) == pytest.approx(1.0)  # no jump at the warm-up's end


def test_no_warmup_starts_at_peak():
    s = make([Phase(4, 32, 50)], 4, warmup_epochs=0, decay="linear")
    assert s.lr_at(0) == pytest.approx(base_lr(50))


@pytest.mark.parametrize("decay", ["linear", "cosine", "poly"])
@pytest.mark.parametrize("final", [0.0, 0.05])
def test_decay_shape_runs_from_peak_to_final_factor(decay, final):
    s = make([Phase(6, 32, 50)], 6, warmup_epochs=1, decay=decay, final_lr_factor=final, poly_power=2.0)
    assert s.lr_shape(1.0) == pytest.approx(1.0)
    assert s.lr_shape(6.0) == pytest.approx(final)
    assert s.lr_at(s.total_samples) == pytest.approx(base_lr(50) * final)
    mid = s.lr_shape(3.5)
    expect = {"linear": 0.5, "cosine": 0.5, "poly": 0.25}[decay]
    assert mid == pytest.approx(final + (1 - final) * expect)


def test_step_decay_multiplies_by_gamma_at_each_milestone():
    s = make([Phase(6, 32, 50)], 6, warmup_epochs=0, decay="step", step_milestones=[2, 4], step_gamma=0.1)
    assert s.lr_shape(0.0) == pytest.approx(1.0)
    assert s.lr_shape(1.99) == pytest.approx(1.0)
    assert s.lr_shape(2.0) == pytest.approx(0.1)
    assert s.lr_shape(4.0) == pytest.approx(0.01)
    assert s.lr_at(s.epoch_start(4)) == pytest.approx(base_lr(50) * 0.01)


def test_decay_none_keeps_peak_after_warmup():
    s = make([Phase(4, 32, 50)], 4, warmup_epochs=1, decay="none")
    assert s.lr_shape(1.0) == s.lr_shape(4.0) == 1.0


def test_momentum_constant_unless_momentum_schedule():
    off = make([Phase(4, 32, 50)], 4, warmup_epochs=1, decay="cosine")
    assert {off.momentum_at(off.epoch_start(e)) for e in range(4)} == {0.9}
    on = make([Phase(4, 32, 50)], 4, warmup_epochs=1, decay="cosine", momentum_schedule=True,
              warmup_start_factor=0.1)
    assert on.momentum_at(0) == pytest.approx(0.9 - 0.1 * 0.1)
    assert on.momentum_at(on.epoch_start(1)) == pytest.approx(0.8)  # LR at peak -> momentum lowest
    assert on.momentum_at(on.total_samples) == pytest.approx(0.9)  # LR decayed to 0 -> momentum back


def test_scheduled_momentum_never_negative():
    sched = ScheduleConfig(epochs=2, warmup_epochs=0, decay="cosine", momentum_schedule=True,
                           phases=[Phase(2, 32, 50)])
    s = Schedule(sched, OptimConfig(momentum=0.05), N)
    assert s.momentum_at(0) >= 0.0


def test_batch_larger_than_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="global batch 2000 of epoch 0 exceeds the 1000 training samples"):
        make([Phase(2, 32, 2000)], 2)


@pytest.mark.parametrize("recipe,arch,resolutions", [
    ("imagenet-rn50-dawnbench", "resnet50", [128, 224, 288]),
    ("imagenet-rn18-16ep", "resnet18", [160, 192]),
])
def test_imagenet_recipes_load_and_scale_lr_with_each_phase_batch(recipe, arch, resolutions):
    from lightray.config import load_config

    cfg = load_config(recipe)
    assert cfg.model.arch == arch
    assert [p.resolution for p in cfg.schedule.phases] == resolutions
    s = Schedule(cfg.schedule, cfg.optim, 1_281_167)  # ImageNet-1k train images
    for e in range(cfg.schedule.epochs):
        b = s.phase_for_epoch(e).batch_size
        start = s.epoch_start(e)
        assert s.lr_at(start) == pytest.approx(cfg.optim.lr_per_256 * b / 256 * s.lr_shape(float(e)))


# --- budget-relative schedules: fractions of schedule.epochs resolve to whole epochs -----------------------
def _fractions(epochs: int, ends: list[float], **kw) -> ScheduleConfig:
    return ScheduleConfig(epochs=epochs, phases=[Phase(resolution=32 + 16 * i, batch_size=64, until=u)
                                                 for i, u in enumerate(ends)], **kw)


@pytest.mark.parametrize("epochs, expected", [
    (4, [(0, 2), (2, 3), (3, 4)]),  # 1.5 rounds half up to 2
    (8, [(0, 3), (3, 6), (6, 8)]),
    (16, [(0, 6), (6, 12), (12, 16)]),
    (32, [(0, 12), (12, 24), (24, 32)]),
])
def test_fractions_stretch_with_the_budget(epochs, expected):
    resolved = resolve(_fractions(epochs, [0.375, 0.75, 1.0]), OptimConfig(lr_per_256=0.4))
    assert [(p.first_epoch, p.end_epoch) for p in resolved.phases] == expected
    assert resolved.epochs == epochs


def test_rounding_gives_every_phase_at_least_one_epoch():
    # 0.05 * 10 = 0.5 rounds half up to 1; 0.1 * 10 = 1 would leave phase 1 empty, so it is pushed to 2.
    ends = phase_ends(_fractions(10, [0.05, 0.1, 1.0]))
    assert ends == [1, 2, 10]
    # 0.95 * 4 rounds to 4, but the last phase still needs one epoch.
    assert phase_ends(_fractions(4, [0.5, 0.95, 1.0])) == [2, 3, 4]


def test_budget_shorter_than_the_phases_leaves_out_the_earliest():
    resolved = resolve(_fractions(2, [0.375, 0.75, 1.0]), OptimConfig())
    assert [(p.first_epoch, p.end_epoch) for p in resolved.phases] == [(0, 0), (0, 1), (1, 2)]
    s = Schedule(_fractions(2, [0.375, 0.75, 1.0]), OptimConfig(), N)
    assert [s.phase_index_for_epoch(e) for e in range(2)] == [1, 2]


def test_warmup_fraction_scales_with_the_budget_and_absolute_epochs_stay():
    assert warmup_epochs(_fractions(16, [1.0], warmup=0.0625)) == 1.0
    assert warmup_epochs(_fractions(32, [1.0], warmup=0.0625)) == 2.0
    assert warmup_epochs(_fractions(28, [1.0], warmup=0.1786)) == 5.0  # a rounded recipe fraction
    assert warmup_epochs(ScheduleConfig(epochs=32, warmup_epochs=1.5)) == 1.5
    s = Schedule(_fractions(8, [1.0], warmup=0.25, warmup_start_factor=0.0, decay="none"), OptimConfig(), N)
    assert s.lr_shape(1.0) == pytest.approx(0.5)  # halfway through a 2-epoch warm-up


def test_explicit_until_epoch_still_sets_absolute_phases():
    resolved = resolve(ScheduleConfig(epochs=10, phases=[Phase(4, 32, 64), Phase(12, 48, 32)]),
                       OptimConfig(lr_per_256=0.4))
    assert [(p.first_epoch, p.end_epoch) for p in resolved.phases] == [(0, 4), (4, 10)]
    assert [p.lr_peak for p in resolved.phases] == pytest.approx([0.4 * 64 / 256, 0.4 * 32 / 256])


def test_resolved_schedule_describes_each_phase():
    resolved = resolve(_fractions(8, [0.375, 0.75, 1.0], warmup=0.0625), OptimConfig(lr_per_256=0.4))
    text = resolved.describe()
    assert "8 epochs, warm-up 0.5 epochs" in text
    assert "phase 2: epochs 6-7, 64px, batch 64" in text
    assert resolved.to_dict()["phases"][1]["end_epoch"] == 6
