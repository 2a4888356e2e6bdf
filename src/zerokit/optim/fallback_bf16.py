"""Pure-torch host optimizer steps for bf16 master weights and/or bf16 optimizer states, giving
the native kernels' bits exactly (csrc/kernels/stream.h, `Io` with any bf16 storage).

Math is fp32: bf16 buffers widen exactly on load and round on store (nearest even, or
stochastically: zerokit/optim/rounding.py). Every operation is one IEEE-rounded torch op (mul,
add, sub, div; sqrt correctly rounded, see _sqrt) in the kernels' order, with scalars rounded to float as the kernels round
them, and no fused multiply-add on either side, so the results are bit-identical on every ISA.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from zerokit.optim import rounding

_SLICE = 1 << 20


def f32(x: float) -> float:
    """x rounded to float32, as static_cast<float> does in kernels/dispatch.cpp."""
    return struct.unpack("f", struct.pack("f", float(x)))[0]


@dataclass(frozen=True)
class Storage:
    """Rounding of one call: stochastic or nearest, the seed, the step that keys it, and the
    index of element 0 in the rounding stream (see Rounding in kernels/step_args.h)."""

    stochastic: bool
    seed: int
    step: int
    index_base: int

    def key(self, buffer: int) -> int:
        return rounding.sr_key(self.seed, self.step, buffer) if self.stochastic else 0


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    # torch.sqrt on CPU may go through MKL's vector math, which is accurate to ~1 ulp but not
    # always correctly rounded; the kernels' sqrt is. A float's square root taken in double and
    # rounded to float is the correctly rounded one (double has more than 2 * 24 + 2 bits).
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


def _slices(n: int):
    for start in range(0, n, _SLICE):
        yield slice(start, min(n, start + _SLICE))


def _store(dst: torch.Tensor, s: slice, x: torch.Tensor, st: Storage, buffer: int) -> None:
    if dst.dtype == torch.bfloat16:
        dst[s].copy_(rounding.to_bf16(x, stochastic=st.stochastic, key=st.key(buffer),
                                      index0=st.index_base + s.start))
    else:
        dst[s].copy_(x)


def _put_param(master, s, p, st: Storage, out16) -> None:
    _store(master, s, p, st, 0)
    if out16 is not None:
        # A bf16 master's 16-bit copy is the stored master itself (see Io::put_param).
        out16[s].copy_(master[s] if master.dtype == torch.bfloat16 else p)


def _grad(grad, s, grad_scale):
    return grad[s].to(torch.float32) * grad_scale


def adam_step(master, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
              adamw, bias_correction_on, grad_scale, out16, storage: Storage) -> None:
    bc1 = 1.0 - math.pow(beta1, step) if bias_correction_on else 1.0
    bc2 = 1.0 - math.pow(beta2, step) if bias_correction_on else 1.0
    gs, l2d, pd = f32(grad_scale), f32(weight_decay), f32(1.0 - lr * weight_decay)
    omb1, b2, omb2, e = f32(1.0 - beta1), f32(beta2), f32(1.0 - beta2), f32(eps)
    ibc2, nss = f32(1.0 / math.sqrt(bc2)), f32(-(lr / bc1))
    l2 = not adamw and weight_decay != 0.0
    decoupled = adamw and weight_decay != 0.0
    for s in _slices(master.numel()):
        g = _grad(grad, s, gs)
        p = master[s].to(torch.float32)
        if l2:
            g = p * l2d + g
        if decoupled:
            p = p * pd
        m = exp_avg[s].to(torch.float32)
        m = omb1 * (g - m) + m
        v = exp_avg_sq[s].to(torch.float32)
        v = (omb2 * g) * g + v * b2
        denom = _sqrt(v) * ibc2 + e
        p = p + (nss * m) / denom
        _store(exp_avg, s, m, storage, 1)
        _store(exp_avg_sq, s, v, storage, 2)
        _put_param(master, s, p, storage, out16)


def adagrad_step(master, grad, state_sum, *, lr, lr_decay, eps, weight_decay, step, grad_scale,
                 out16, storage: Storage) -> None:
    gs, l2d, e = f32(grad_scale), f32(weight_decay), f32(eps)
    nclr = f32(-(lr / (1.0 + (step - 1) * lr_decay)))
    for s in _slices(master.numel()):
        g = _grad(grad, s, gs)
        p = master[s].to(torch.float32)
        if weight_decay != 0.0:
            g = p * l2d + g
        acc = state_sum[s].to(torch.float32) + g * g
        std = _sqrt(acc) + e
        p = p + (nclr * g) / std
        _store(state_sum, s, acc, storage, 1)
        _put_param(master, s, p, storage, out16)


def lion_step(master, grad, exp_avg, *, lr, beta1, beta2, weight_decay, grad_scale, out16,
              storage: Storage) -> None:
    gs, pd, nlr = f32(grad_scale), f32(1.0 - lr * weight_decay), f32(-lr)
    b1, omb1, b2, omb2 = f32(beta1), f32(1.0 - beta1), f32(beta2), f32(1.0 - beta2)
    for s in _slices(master.numel()):
        g = _grad(grad, s, gs)
        p = master[s].to(torch.float32)
        m = exp_avg[s].to(torch.float32)
        if weight_decay != 0.0:
            p = p * pd
        c = g * omb1 + m * b1
        p = torch.sign(c) * nlr + p
        m = g * omb2 + m * b2
        _store(exp_avg, s, m, storage, 1)
        _put_param(master, s, p, storage, out16)
