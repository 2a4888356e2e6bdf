"""Compute dtype, loss scaling and overflow handling.

With fp16, static or dynamic scale alike, a step whose gradients overflowed is skipped on every
rank (DeepSpeed's FP16 and ZeRO optimizers check either way). Dynamic loss scaling follows
DeepSpeed's DynamicLossScaler exactly: the scale is divided by 2 once `hysteresis` overflows have
been absorbed (never below min_loss_scale); after `loss_scale_window` iterations without overflow
it doubles. An overflow that would lower a scale already at min_loss_scale raises
LossScaleAtMinimumError with DeepSpeed's message (fp16.raise_error_at_min_scale, default true, as
DeepSpeed's DynamicLossScaler(raise_error_at_min_scale=True)); false skips such steps instead.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from zerokit.config.schema import ZeroKitConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cast_inputs_half(inputs: Any) -> Any:
    """fp16.auto_cast, as DeepSpeed's engine._cast_inputs_half: floating tensors among the forward's
    positional inputs (through lists, tuples and dicts) become fp16; keyword arguments, integer
    tensors and everything else pass unchanged."""
    if isinstance(inputs, (list, tuple)):
        cast = [cast_inputs_half(v) for v in inputs]
        return type(inputs)(*cast) if hasattr(inputs, "_fields") else type(inputs)(cast)
    if isinstance(inputs, dict):
        return {k: cast_inputs_half(v) for k, v in inputs.items()}
    if torch.is_tensor(inputs) and inputs.is_floating_point():
        return inputs.half()
    return inputs


def compute_dtype(config: ZeroKitConfig) -> torch.dtype:
    return DTYPES[config.compute_dtype_name]


def reduce_dtype(config: ZeroKitConfig) -> torch.dtype:
    if config.communication_data_type is not None:
        return DTYPES[config.communication_data_type]
    # bf16 has 8 mantissa bits: summing N ranks' gradients in it loses what fp32 keeps for 2x
    # the bytes; fp16 keeps DeepSpeed's default (reduce in fp16, protected by the loss scale).
    return torch.float16 if config.fp16.enabled else torch.float32


class LossScaleAtMinimumError(Exception):
    """fp16 gradients overflowed with the loss scale already at min_loss_scale: training cannot
    go on (DeepSpeed raises a bare Exception with the same message)."""


AT_MINIMUM = "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."


@dataclass
class LossScaler:
    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    factor: float = 2.0
    cur_iter: int = 0
    last_overflow_iter: int = -1
    cur_hysteresis: int = 2
    checks_overflow: bool = False  # fp16, static or dynamic scale: a non-finite gradient skips the step
    raise_at_min: bool = True  # fp16.raise_error_at_min_scale

    @classmethod
    def from_config(cls, config: ZeroKitConfig) -> "LossScaler":
        fp16 = config.fp16
        if not fp16.enabled:
            return cls()
        if fp16.loss_scale > 0:
            return cls(scale=float(fp16.loss_scale), checks_overflow=True)
        return cls(scale=float(2 ** fp16.initial_scale_power), dynamic=True, checks_overflow=True,
                   window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
                   consecutive_hysteresis=fp16.consecutive_hysteresis,
                   min_scale=fp16.min_loss_scale, cur_hysteresis=fp16.hysteresis,
                   raise_at_min=fp16.raise_error_at_min_scale)

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.scale == self.min_scale and self.raise_at_min:
                    raise LossScaleAtMinimumError(AT_MINIMUM)
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            # Clean iterations since the last overflow, this one excluded (DeepSpeed 0.19's count).
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= self.factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for k, v in sd.items():
            setattr(self, k, v)


def with_gradient_dtype(cfg: ZeroKitConfig, placement, world_size: int, grad_accum_steps: int):
    """`placement` with the dtype its offloaded gradients wait in (offload_optimizer.gradient_dtype).

    [Note: 16-bit offloaded gradients]
    An offloaded part keeps its gradient from backward to the step: a host buffer, a held
    gradient, or an NVMe file, in the master's dtype as DeepSpeed does (4 bytes per element, and
    at 4.35B parameters 17 GB of gradient files written and read every step). Where every value
    that lands there is a 16-bit number, the 16-bit dtype holds it exactly and the kernel, which
    widens whatever gradient dtype it reads, computes the same bits. That is the case when
    nothing is summed there (one micro-step per step) and what lands is 16-bit: the collective
    runs in a 16-bit reduce dtype (its result is that dtype), or there is one rank and the
    gradients are the 16-bit compute dtype's (at world 1 no collective or scale touches them:
    comm/collectives.py, units/reduction.py). A second backward before step() would sum in 16
    bits, so the parts refuse it (parts/held_gradient.py `refuse_sum`)."""
    if cfg.zero_optimization.offload_optimizer.gradient_dtype == "master" or not placement.offloads:
        return placement
    if grad_accum_steps != 1 or placement.master_dtype != torch.float32:
        return placement
    reduce, compute = reduce_dtype(cfg), compute_dtype(cfg)
    sixteen = (torch.bfloat16, torch.float16)
    exact = reduce if reduce in sixteen else compute if world_size == 1 and compute in sixteen else None
    return placement if exact is None else replace(placement, grad_dtype=exact)
