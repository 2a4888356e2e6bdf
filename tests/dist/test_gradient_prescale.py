"""prescale_gradients and gradient_predivide_factor (DeepSpeed's meanings): the gradients are
divided before the reduction (a sum) by world_size, or by the factor f and after it by
world_size / f. Checked element-wise with SGD on the weights against plain torch, with fp16
reductions and per-rank gradients of 40960 each: their plain sum (81920) overflows fp16 (max
65504), so only a division *before* the sum gives a finite step, and a missing or wrong division
after it moves every weight by the wrong multiple.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from harness import run_world

LR, GRAD = 2.0 ** -16, 40960.0  # 40960 = 1280 * 32: exact in fp16, as are all the partial values


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4, bias=False), nn.Linear(4, 2, bias=False))


def _step(rank: int, world: int, stage: int, extra: dict) -> dict:
    import zerokit

    model = _model()
    engine, *_ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "communication_data_type": "fp16",
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage}, **extra})
    # loss = GRAD * sum(w): every gradient element is GRAD on every rank, and so is their mean.
    loss = sum(p.sum() for p in engine.module.parameters()) * GRAD
    engine.backward(loss)
    engine.step()
    return {k: v.clone() for k, v in engine.consolidated_fp32_state_dict().items()}


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("extra", [{"gradient_predivide_factor": 2.0}, {"gradient_predivide_factor": 4.0},
                                   {"prescale_gradients": True}], ids=["predivide2", "predivide4", "prescale"])
def test_gradients_are_divided_before_the_reduction(stage: int, extra: dict) -> None:
    expected = {k: v - LR * GRAD for k, v in _model().state_dict().items()}  # SGD on the mean, GRAD
    for r in run_world(_step, 2, stage, extra):
        for name, v in expected.items():
            assert torch.isfinite(r[name]).all(), f"{name}: the fp16 sum overflowed (not divided before it)"
            torch.testing.assert_close(r[name], v, rtol=0, atol=0)


def test_without_division_before_the_sum_the_fp16_reduction_overflows() -> None:
    """The control: the same step with DeepSpeed's defaults (divide after the sum) overflows, so
    the test above can tell a division before the sum from one after it. The overflowed step is
    skipped (`nonfinite: "skip"`, issue #19): the weights stay as built, never the expected update
    and never non-finite."""
    built = _model().state_dict()
    for r in run_world(_step, 2, 0, {}):
        for name, v in built.items():
            assert torch.isfinite(r[name]).all(), f"{name}: a non-finite update was applied"
            torch.testing.assert_close(r[name], v, rtol=0, atol=0)
