"""parts/device.py: the device part of a unit's optimizer range, on its own (no engine).

HostPart and NvmePart are exercised through engines (dist/test_offload.py,
dist/test_nvme_optimizer.py, dist/test_step_in_backward.py) and HeldGradient in
unit/test_held_gradient.py.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from zerokit.parts.device import DevicePart
from zerokit.policy.layout import OptimizerPart


def _part(master: list[float], *, home_dtype=torch.bfloat16, in_place=False, adds=False):
    home = torch.zeros(len(master), dtype=home_dtype)
    p = DevicePart(OptimizerPart("device", 64, 64 + len(master)),
                   nn.Parameter(torch.tensor(master)), torch.zeros(len(master)), home, in_place,
                   shard_gradients=adds)
    return p, home


def test_a_reduction_writes_below_stage_2_and_adds_from_stage_2() -> None:
    # See [Note: one reduction, one meaning] in units/reduction.py.
    once, _ = _part([0.0] * 4)
    once.grad.fill_(7.0)  # whatever was there before the step's one reduction
    once.take_grad(torch.tensor([1.0, 2.0]), 1)
    assert once.grad.tolist() == [7.0, 1.0, 2.0, 7.0]
    every, _ = _part([0.0] * 4, adds=True)
    every.take_grad(torch.tensor([1.0, 2.0]), 1)
    every.take_grad(torch.tensor([0.5, 0.5]), 2)
    assert every.grad.tolist() == [0.0, 1.0, 2.5, 0.5]
    assert (every.lo, every.hi, every.numel) == (64, 68, 4)


def test_grad_sq_norm_is_the_sum_of_squares_in_float64() -> None:
    p, _ = _part([0.0] * 3)
    p.grad.copy_(torch.tensor([3.0, 4.0, 12.0]))
    norm = p.grad_sq_norm()
    assert norm.dtype == torch.float64 and norm.item() == 9.0 + 16.0 + 144.0
    p.zero_grad()
    assert p.grad.tolist() == [0.0, 0.0, 0.0]


def test_new_weights_are_copied_home_unless_the_master_is_the_weights() -> None:
    p, home = _part([1.5, -2.25])
    p.write_weights()
    assert home.tolist() == [1.5, -2.25] and home.dtype == torch.bfloat16
    same, home = _part([1.5, -2.25], in_place=True)
    same.write_weights()
    assert home.tolist() == [0.0, 0.0]  # in place: the optimizer already wrote the weights


def test_edited_weights_keep_the_fp32_value_where_the_16bit_rounding_did_not_change() -> None:
    # 1 + 2**-10 rounds to 1.0 in bf16 (8 bits of mantissa): an edit that leaves 1.0 there must
    # not throw the fp32 master's extra bits away; the edited element takes the new value.
    p, _ = _part([1.0 + 2**-10, 3.0])
    p.absorb(torch.tensor([1.0, 5.0], dtype=torch.bfloat16))
    assert p.master.tolist() == [1.0 + 2**-10, 5.0]
    fp32, _ = _part([1.0 + 2**-10, 3.0], home_dtype=torch.float32, in_place=True)
    fp32.absorb(torch.tensor([9.0, 9.0]))
    assert fp32.master.tolist() == [1.0 + 2**-10, 3.0]  # in place: the master is the weights
