"""Shared pieces of the host optimizer tests: which implementations to test, plain torch
references, and tolerances (with the reasoning for them)."""
from __future__ import annotations

import pytest
import torch

from zerokit.optim import available_isas

# Every native ISA this CPU can run (a lower ISA is forced by name) plus the pure-torch fallback.
IMPLS = [*available_isas(), "fallback"]
LENGTHS = [1, 7, 1023, 1_000_003]  # 1023 and 1_000_003: SIMD tails; the large one spans threads
STEPS = 20

# fp32 tolerances. rtol is the 1e-6 element-wise bound. The kernels round a few operations
# differently from torch's op-by-op path (fused multiply-adds, 1/sqrt(bc2) multiplied rather than
# divided), which moves a result by an ulp or so *of the terms that formed it*. For parameters
# the last term is the update, of size ~lr, so a parameter that happens to sit near zero carries
# an absolute error of a few ulp(lr) that no relative bound can absorb: atol covers exactly that
# (1e-5 * lr is ~100x ulp(lr) and ~100x below any real deviation, which would be of order lr).
RTOL = 1e-6


def param_atol(lr: float) -> float:
    return 1e-5 * lr


def state_atol(scale: float) -> float:
    """For exp_avg (a blend of gradients of magnitude `scale`, which can cancel towards zero)."""
    return 1e-7 * scale


def lrs(base: float):
    """A different learning rate every step, as a scheduler would give."""
    return [base * (1.0 + 0.37 * ((7 * s) % 5) - 0.1 * s / STEPS) for s in range(1, STEPS + 1)]


class RefLion:
    """Lion as published (Chen et al. 2023, lucidrains/lion-pytorch), plain torch, fp32."""

    def __init__(self, p: torch.Tensor, beta1: float, beta2: float, weight_decay: float):
        self.p, self.m = p, torch.zeros_like(p)
        self.beta1, self.beta2, self.wd = beta1, beta2, weight_decay

    def step(self, grad: torch.Tensor, lr: float) -> None:
        self.p.mul_(1 - lr * self.wd)
        update = self.m.mul(self.beta1).add(grad, alpha=1 - self.beta1).sign_()
        self.p.add_(update, alpha=-lr)
        self.m.mul_(self.beta2).add_(grad, alpha=1 - self.beta2)


def ordered_bits16(t: torch.Tensor) -> torch.Tensor:
    """16-bit floats as integers that are consecutive for adjacent representable values."""
    bits = t.view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.where(bits >= 0x8000, -(bits & 0x7FFF), bits)


def assert_within_one_ulp16(actual: torch.Tensor, expected: torch.Tensor) -> None:
    dist = (ordered_bits16(actual) - ordered_bits16(expected)).abs()
    worst = int(dist.max()) if dist.numel() else 0
    assert worst <= 1, f"16-bit outputs differ by up to {worst} ulp at {int(dist.argmax())}"


def skip_unless_native(impl: str):
    if impl != "fallback" and impl not in available_isas():
        pytest.skip(f"{impl} not available")
