"""Pure-torch host optimizer steps with the native kernels' semantics (kernels/*.h).

Used when the extension is not built or when forced (impl="fallback", ZEROKIT_FORCE_FALLBACK=1).
Hyper-parameters become the same scalars the native dispatcher computes (kernels/dispatch.cpp),
in double, then torch rounds them to float as the kernels do, so the two paths agree to an ulp or
so per step. Work is done in slices so temporaries stay small on 100M-element shards.
"""
from __future__ import annotations

import math

import torch

# Elements per slice: a few MiB of temporaries, large enough that per-op overhead is negligible.
_SLICE = 1 << 20


def bias_correction(beta: float, step: int) -> float:
    """1 - beta**step in double. See [Note: bias correction] in kernels/dispatch.h: the native
    kernels compute the same expression with the same libm pow, so both are bit-identical."""
    return 1.0 - math.pow(float(beta), float(step))


def _slices(n: int):
    for start in range(0, n, _SLICE):
        yield slice(start, min(n, start + _SLICE))


def _scaled_grad(grad: torch.Tensor, grad_scale: float) -> torch.Tensor:
    # Always a fresh fp32 tensor: the caller's gradient is never modified.
    return grad.to(torch.float32, copy=True).mul_(grad_scale)


def adam_step(master, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
              adamw, bias_correction_on, grad_scale, out16) -> None:
    bc1 = bias_correction(beta1, step) if bias_correction_on else 1.0
    bc2 = bias_correction(beta2, step) if bias_correction_on else 1.0
    inv_bc2_sqrt = 1.0 / math.sqrt(bc2)
    neg_step_size = -(lr / bc1)
    param_decay = 1.0 - lr * weight_decay
    l2 = not adamw and weight_decay != 0.0
    decoupled = adamw and weight_decay != 0.0
    for s in _slices(master.numel()):
        p, m, v = master[s], exp_avg[s], exp_avg_sq[s]
        g = _scaled_grad(grad[s], grad_scale)
        if l2:
            g.add_(p, alpha=weight_decay)
        if decoupled:
            p.mul_(param_decay)
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = v.sqrt().mul_(inv_bc2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=neg_step_size)
        if out16 is not None:
            out16[s].copy_(p)


def adagrad_step(master, grad, state_sum, *, lr, lr_decay, eps, weight_decay, step, grad_scale,
                 out16) -> None:
    neg_clr = -(lr / (1.0 + (step - 1) * lr_decay))
    for s in _slices(master.numel()):
        p, acc = master[s], state_sum[s]
        g = _scaled_grad(grad[s], grad_scale)
        if weight_decay != 0.0:
            g.add_(p, alpha=weight_decay)
        acc.addcmul_(g, g, value=1.0)
        std = acc.sqrt().add_(eps)
        p.addcdiv_(g, std, value=neg_clr)
        if out16 is not None:
            out16[s].copy_(p)


def lion_step(master, grad, exp_avg, *, lr, beta1, beta2, weight_decay, grad_scale, out16) -> None:
    param_decay = 1.0 - lr * weight_decay
    for s in _slices(master.numel()):
        p, m = master[s], exp_avg[s]
        g = _scaled_grad(grad[s], grad_scale)
        if weight_decay != 0.0:
            p.mul_(param_decay)
        update = m.mul(beta1).add_(g, alpha=1.0 - beta1).sign_()
        p.add_(update, alpha=-lr)
        m.mul_(beta2).add_(g, alpha=1.0 - beta2)
        if out16 is not None:
            out16[s].copy_(p)


def grad_sq_norm(grad: torch.Tensor) -> float:
    """Sum of squares accumulated in double, like the native kernel (see kernels/norm.h)."""
    total = 0.0
    for s in _slices(grad.numel()):
        x = grad[s].to(torch.float64)
        total += float(torch.dot(x, x))
    return total
