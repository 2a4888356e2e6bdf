"""The host kernels' bf16-storage steps on any device: fallback_bf16's torch ops behind host.py's
signatures (`adam_step`, `adagrad_step`, `lion_step`), for the device part of a unit whose master
is bf16 (bf16.bf16_master_weights_and_grads; parts/executors.py `DeviceExecutor`).

fallback_bf16 gives the native kernels' bits (every op one IEEE-rounded torch op, in the kernels'
order, square roots taken in double), so a Twin-Flow device part and a host part step their
elements alike, and stochastic rounding draws the same bits from (seed, step, buffer, index).
torch's own optimizers would compute in bf16 on a bf16 master; DeepSpeed's bf16 master does the
same, zerokit keeps fp32 math with one rounding per store on every tier.

Unlike host.py these take tensors on any device and check only what the fallback needs: one
length, contiguous buffers, the master bf16 or fp32 with at least one bf16 buffer.
"""
from __future__ import annotations

import torch

from zerokit.optim import fallback_bf16

__all__ = ["adam_step", "adagrad_step", "lion_step"]


def _storage(master: torch.Tensor, states: tuple, step: int | None, stochastic_rounding: bool,
             seed: int, index_base: int) -> fallback_bf16.Storage:
    n = master.numel()
    for name, t in (("master", master),) + tuple((f"state{i}", s) for i, s in enumerate(states)):
        if t.dtype not in (torch.float32, torch.bfloat16) or not t.is_contiguous() or t.numel() != n:
            raise ValueError(f"device bf16 step: {name} must be a contiguous fp32/bf16 tensor of "
                             f"{n} elements (got {t.dtype}, {t.numel()}, contiguous "
                             f"{t.is_contiguous()})")
    if master.dtype != torch.bfloat16 and all(s.dtype != torch.bfloat16 for s in states):
        raise ValueError("device bf16 step: every buffer is fp32; step it with torch's optimizer")
    return fallback_bf16.Storage(bool(stochastic_rounding), int(seed), int(step or 1),
                                 int(index_base))


def adam_step(master, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
              adamw, bias_correction=True, grad_scale=1.0, out16=None,
              stochastic_rounding=False, seed=0, index_base=0) -> None:
    st = _storage(master, (exp_avg, exp_avg_sq), step, stochastic_rounding, seed, index_base)
    if master.numel():
        fallback_bf16.adam_step(master, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2,
                                eps=eps, weight_decay=weight_decay, step=step, adamw=bool(adamw),
                                bias_correction_on=bool(bias_correction), grad_scale=grad_scale,
                                out16=out16, storage=st)


def adagrad_step(master, grad, state_sum, *, lr, eps, weight_decay, step, lr_decay=0.0,
                 grad_scale=1.0, out16=None, stochastic_rounding=False, seed=0,
                 index_base=0) -> None:
    st = _storage(master, (state_sum,), step, stochastic_rounding, seed, index_base)
    if master.numel():
        fallback_bf16.adagrad_step(master, grad, state_sum, lr=lr, lr_decay=lr_decay, eps=eps,
                                   weight_decay=weight_decay, step=step, grad_scale=grad_scale,
                                   out16=out16, storage=st)


def lion_step(master, grad, exp_avg, *, lr, beta1, beta2, weight_decay, grad_scale=1.0,
              out16=None, stochastic_rounding=False, seed=0, index_base=0, step=None) -> None:
    st = _storage(master, (exp_avg,), step, stochastic_rounding, seed, index_base)
    if master.numel():
        fallback_bf16.lion_step(master, grad, exp_avg, lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=weight_decay, grad_scale=grad_scale, out16=out16,
                                storage=st)
