"""engine/precision.py: loss scaling follows DeepSpeed's rules, step by step."""
from __future__ import annotations

import pytest

from zerokit.config import load_config
from zerokit.engine.precision import LossScaleAtMinimumError, LossScaler


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
