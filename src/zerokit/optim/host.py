"""Host optimizer steps on flat shards: the functions the engine calls.

Every buffer is a flat (or any-shape) contiguous CPU tensor of the same number of elements:

    master, exp_avg, exp_avg_sq, state_sum   fp32, updated in place
    grad                                     fp32, bf16 or fp16; read only
    out16                                    optional bf16/fp16 buffer; receives the new master
                                             rounded to nearest even (same bits as .to(dtype))

One call is one pass over memory: the gradient is widened, multiplied by `grad_scale` (pass
clip_coef / loss_scale to unscale and clip in the same pass), the master and state are updated,
and out16 is written. Hyper-parameters are per call, so schedulers just pass new values; `step`
is the 1-based count of this update and drives bias correction (see `bias_correction`).

`impl` and `threads` choose the implementation (zerokit/optim/backend.py); None means the default.
"""
from __future__ import annotations

import math

import torch

from zerokit.optim import fallback
from zerokit.optim.backend import DTYPE_CODES, NO_DTYPE, native_module, resolve

__all__ = ["adam_step", "adagrad_step", "lion_step", "grad_sq_norm", "bias_correction"]

_GRAD_DTYPES = tuple(DTYPE_CODES)
_OUT_DTYPES = (torch.bfloat16, torch.float16)


def bias_correction(beta: float, step: int) -> float:
    """1 - beta**step, computed in double as 1.0 - pow(beta, step) on both paths, so a run resumed
    from a checkpoint (on either path) reproduces the same scalars bit for bit."""
    return fallback.bias_correction(beta, step)


def _check_buffer(name: str, t, n: int | None, dtypes: tuple) -> int:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; host kernels need CPU tensors")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; allowed: {allowed}")
    if not t.is_contiguous():
        raise ValueError(f"{name} (shape {tuple(t.shape)}, strides {t.stride()}) is not contiguous")
    if n is not None and t.numel() != n:
        raise ValueError(f"{name} has {t.numel()} elements but master has {n}")
    return t.numel()


def _check_step(step) -> int:
    if isinstance(step, torch.Tensor):
        step = step.item()
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"step={step!r} must be an int >= 1 (the 1-based count of this update)")
    return step


def _scalar(name: str, x) -> float:
    x = float(x.item() if isinstance(x, torch.Tensor) else x)
    if not math.isfinite(x):
        raise ValueError(f"{name}={x!r} must be finite")
    return x


def _buffers(master, grad, states: dict, out16):
    n = _check_buffer("master", master, None, (torch.float32,))
    _check_buffer("grad", grad, n, _GRAD_DTYPES)
    for name, t in states.items():
        _check_buffer(name, t, n, (torch.float32,))
    if out16 is not None:
        _check_buffer("out16", out16, n, _OUT_DTYPES)
    return n


def _out_args(out16) -> tuple[int, int]:
    return (0, NO_DTYPE) if out16 is None else (out16.data_ptr(), DTYPE_CODES[out16.dtype])


def adam_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
              weight_decay: float, step: int, adamw: bool, bias_correction: bool = True,
              grad_scale: float = 1.0, out16: torch.Tensor | None = None,
              impl: str | None = None, threads: int | None = None) -> None:
    """One Adam (adamw=False: weight decay added to the gradient, torch.optim.Adam) or AdamW
    (adamw=True: decoupled decay, torch.optim.AdamW) update, in place."""
    n = _buffers(master, grad, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, out16)
    step = _check_step(step)
    h = dict(lr=_scalar("lr", lr), beta1=_scalar("beta1", beta1), beta2=_scalar("beta2", beta2),
             eps=_scalar("eps", eps), weight_decay=_scalar("weight_decay", weight_decay),
             grad_scale=_scalar("grad_scale", grad_scale))
    if n == 0:
        return
    chosen = resolve(impl, threads)
    if not chosen.native:
        fallback.adam_step(master, grad, exp_avg, exp_avg_sq, step=step, adamw=bool(adamw),
                           bias_correction_on=bool(bias_correction), out16=out16, **h)
        return
    out_ptr, out_code = _out_args(out16)
    native_module().adam(
        param=master.data_ptr(), grad=grad.data_ptr(), grad_dtype=DTYPE_CODES[grad.dtype],
        exp_avg=exp_avg.data_ptr(), exp_avg_sq=exp_avg_sq.data_ptr(), out16=out_ptr,
        out_dtype=out_code, n=n, step=step, adamw=bool(adamw),
        bias_correction=bool(bias_correction), isa=chosen.isa_code, threads=chosen.threads, **h)


def adagrad_step(master: torch.Tensor, grad: torch.Tensor, state_sum: torch.Tensor, *, lr: float,
                 eps: float, weight_decay: float, step: int, lr_decay: float = 0.0,
                 grad_scale: float = 1.0, out16: torch.Tensor | None = None,
                 impl: str | None = None, threads: int | None = None) -> None:
    """One Adagrad update (torch.optim.Adagrad semantics, L2 weight decay), in place."""
    n = _buffers(master, grad, {"state_sum": state_sum}, out16)
    step = _check_step(step)
    h = dict(lr=_scalar("lr", lr), lr_decay=_scalar("lr_decay", lr_decay), eps=_scalar("eps", eps),
             weight_decay=_scalar("weight_decay", weight_decay),
             grad_scale=_scalar("grad_scale", grad_scale))
    if n == 0:
        return
    chosen = resolve(impl, threads)
    if not chosen.native:
        fallback.adagrad_step(master, grad, state_sum, step=step, out16=out16, **h)
        return
    out_ptr, out_code = _out_args(out16)
    native_module().adagrad(
        param=master.data_ptr(), grad=grad.data_ptr(), grad_dtype=DTYPE_CODES[grad.dtype],
        state_sum=state_sum.data_ptr(), out16=out_ptr, out_dtype=out_code, n=n, step=step,
        isa=chosen.isa_code, threads=chosen.threads, **h)


def lion_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float,
              beta1: float, beta2: float, weight_decay: float, grad_scale: float = 1.0,
              out16: torch.Tensor | None = None, impl: str | None = None,
              threads: int | None = None) -> None:
    """One Lion update (decoupled weight decay), in place. Lion has no bias correction, hence no
    step argument."""
    n = _buffers(master, grad, {"exp_avg": exp_avg}, out16)
    h = dict(lr=_scalar("lr", lr), beta1=_scalar("beta1", beta1), beta2=_scalar("beta2", beta2),
             weight_decay=_scalar("weight_decay", weight_decay),
             grad_scale=_scalar("grad_scale", grad_scale))
    if n == 0:
        return
    chosen = resolve(impl, threads)
    if not chosen.native:
        fallback.lion_step(master, grad, exp_avg, out16=out16, **h)
        return
    out_ptr, out_code = _out_args(out16)
    native_module().lion(
        param=master.data_ptr(), grad=grad.data_ptr(), grad_dtype=DTYPE_CODES[grad.dtype],
        exp_avg=exp_avg.data_ptr(), out16=out_ptr, out_dtype=out_code, n=n,
        isa=chosen.isa_code, threads=chosen.threads, **h)


def grad_sq_norm(grad: torch.Tensor, *, impl: str | None = None,
                 threads: int | None = None) -> tuple[float, bool]:
    """(sum of squares of grad, all elements finite). The sum is accumulated in double, so it is
    finite exactly when every element is; a NaN or inf gradient is reported, never clipped away."""
    n = _check_buffer("grad", grad, None, _GRAD_DTYPES)
    if n == 0:
        return 0.0, True
    chosen = resolve(impl, threads)
    if chosen.native:
        total = native_module().grad_sq_norm(grad=grad.data_ptr(), grad_dtype=DTYPE_CODES[grad.dtype],
                                             n=n, isa=chosen.isa_code, threads=chosen.threads)
    else:
        total = fallback.grad_sq_norm(grad)
    return total, math.isfinite(total)
