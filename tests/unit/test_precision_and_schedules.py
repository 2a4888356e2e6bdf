"""Loss scaling and LR schedules follow DeepSpeed's rules, step by step."""
from __future__ import annotations

import math

import pytest
import torch

from zerokit.config import load_config
from zerokit.engine.precision import LossScaleAtMinimumError, LossScaler
from zerokit.engine.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR


def _scaler(**fp16) -> LossScaler:
    return LossScaler.from_config(load_config({"train_batch_size": 1, "fp16": {"enabled": True, **fp16}}))


def test_dynamic_scale_hysteresis_backoff_and_growth() -> None:
    s = _scaler(initial_scale_power=4, hysteresis=2, loss_scale_window=3, min_loss_scale=2)
    assert s.scale == 16 and s.dynamic
    s.update(True)   # first overflow absorbed by hysteresis
    assert s.scale == 16
    s.update(True)   # second halves
    assert s.scale == 8
    s.update(True)   # hysteresis stays spent (not consecutive mode): halves again
    assert s.scale == 4
    for _ in range(3):
        s.update(False)
    assert s.scale == 4
    s.update(False)  # 3 clean iterations completed before this one: doubles (DeepSpeed 0.19)
    assert s.scale == 8
    for _ in range(3):  # the growth refilled the hysteresis: absorbed, then 4, then 2
        s.update(True)
    assert s.scale == 2  # at min_loss_scale: the next overflow would go below it, so it raises
    with pytest.raises(LossScaleAtMinimumError, match="Current loss scale already at minimum"):
        s.update(True)  # (DeepSpeed's DynamicLossScaler, raise_error_at_min_scale=True)


def test_min_scale_without_raising_stays_there() -> None:
    s = _scaler(initial_scale_power=2, hysteresis=1, min_loss_scale=1, raise_error_at_min_scale=False)
    for _ in range(10):
        s.update(True)
    assert s.scale == 1  # never below min_loss_scale; every such step is skipped


def test_static_scale_never_moves() -> None:
    s = _scaler(loss_scale=128)
    for overflow in (True, False, True):
        s.update(overflow)
    assert s.scale == 128 and not s.dynamic


def _opt(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_warmup_lr_log_and_linear() -> None:
    opt = _opt()
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=10, warmup_type="log")
    assert opt.param_groups[0]["lr"] == 0.0  # value at iteration -1
    lrs = []
    for _ in range(12):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    expected = [0.01 * math.log(i + 1) / math.log(10) if i < 10 else 0.01 for i in range(12)]
    assert lrs == pytest.approx(expected)
    opt = _opt()
    sched = WarmupLR(opt, 0.0, 0.01, 4, "linear")
    sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * 1 / 4)


def test_warmup_decay_reaches_zero_at_total() -> None:
    opt = _opt()
    sched = WarmupDecayLR(opt, total_num_steps=20, warmup_max_lr=0.01, warmup_num_steps=5, warmup_type="linear")
    for _ in range(21):
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.0
    sched.step(12)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * (20 - 12) / (20 - 5))


def test_warmup_cosine_ratio() -> None:
    opt = _opt(lr=0.2)
    sched = WarmupCosineLR(opt, total_num_steps=12, warmup_num_steps=2, cos_min_ratio=0.1,
                           warmup_type="linear")
    assert opt.param_groups[0]["lr"] == 0.0
    sched.step(1)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2 * 0.5)
    sched.step(11)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2 * 0.1)  # end of the cosine: the floor
    sched.step(6)
    progress = (6 - 2 + 1) / 10
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2 * (0.1 + 0.9 * (1 + math.cos(math.pi * progress)) / 2))
    state = sched.state_dict()
    other = WarmupCosineLR(_opt(lr=0.2), total_num_steps=12, warmup_num_steps=2, cos_min_ratio=0.1,
                           warmup_type="linear")
    other.load_state_dict(state)
    assert other.get_last_lr() == sched.get_last_lr()


def test_bad_schedule_params_are_named() -> None:
    with pytest.raises(ValueError, match="warmup_num_steps"):
        WarmupLR(_opt(), warmup_num_steps=0)
    with pytest.raises(ValueError, match="warmup_type"):
        WarmupLR(_opt(), warmup_type="cubic")
