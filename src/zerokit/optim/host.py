"""Host optimizer steps on flat shards: the functions the engine calls.

Every buffer is a flat (or any-shape) contiguous CPU tensor of the same number of elements:

    master                                   fp32 or bf16, updated in place
    exp_avg, exp_avg_sq, state_sum           fp32 or bf16 (all states of one call alike)
    grad                                     fp32, bf16 or fp16; read only
    out16                                    optional bf16/fp16 buffer; receives the new master
                                             rounded to nearest even (same bits as .to(dtype));
                                             with a bf16 master, the stored master's bits

bf16 master and/or states (DeepSpeed's bf16_master_weights_and_grads / bf16_optimizer_states):
the math stays fp32 (loads widen, stores round), every ISA and the fallback give the same bits
(fallback_bf16.py). `stochastic_rounding=True` rounds the bf16 buffers stochastically with
random bits hashed from (`seed`, `step`, buffer, `index_base` + element index): see
zerokit/optim/rounding.py. Give each shard its own `index_base` (its offset in the parameter
space) so shards draw independent bits and a resumed or resharded run draws the same ones.

One call is one pass over memory: the gradient is widened, multiplied by `grad_scale` (pass
clip_coef / loss_scale to unscale and clip in the same pass), the master and state are updated,
and out16 is written. Hyper-parameters are per call, so schedulers just pass new values; `step`
is the 1-based count of this update and drives bias correction (see `bias_correction`).

`impl` and `threads` choose the implementation (zerokit/optim/backend.py); None means the default.
"""
from __future__ import annotations

import math

import torch

from zerokit.optim import fallback, fallback_bf16
from zerokit.optim.backend import DTYPE_CODES, NO_DTYPE, native_module, resolve

__all__ = ["adam_step", "adagrad_step", "lion_step", "grad_sq_norm", "bias_correction", "accumulate"]

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


_STORED_DTYPES = (torch.float32, torch.bfloat16)


def _buffers(master, grad, states: dict, out16):
    n = _check_buffer("master", master, None, _STORED_DTYPES)
    _check_buffer("grad", grad, n, _GRAD_DTYPES)
    for name, t in states.items():
        _check_buffer(name, t, n, _STORED_DTYPES)
    if len({t.dtype for t in states.values()}) > 1:
        raise ValueError("optimizer states must share one dtype; got "
                         + ", ".join(f"{k}={str(t.dtype).replace('torch.', '')}" for k, t in states.items()))
    if out16 is not None:
        _check_buffer("out16", out16, n, _OUT_DTYPES)
    return n


def _storage(master, states: dict, stochastic_rounding, seed, step: int | None,
             index_base) -> fallback_bf16.Storage | None:
    """None for all-fp32 buffers (the fused mixed kernel); else the rounding of the bf16 ones."""
    bf16 = master.dtype == torch.bfloat16 or any(t.dtype == torch.bfloat16 for t in states.values())
    if not isinstance(stochastic_rounding, bool):
        raise ValueError(f"stochastic_rounding={stochastic_rounding!r} must be a bool")
    if stochastic_rounding and not bf16:
        raise ValueError("stochastic_rounding=True needs a bf16 master or bf16 optimizer states; "
                         "every buffer here is fp32")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
        raise ValueError(f"seed={seed!r} must be an int in [0, 2**64)")
    if not isinstance(index_base, int) or isinstance(index_base, bool) or index_base < 0:
        raise ValueError(f"index_base={index_base!r} must be an int >= 0")
    if not bf16:
        return None
    if stochastic_rounding and step is None:
        raise ValueError("stochastic_rounding=True needs step= (it keys the random bits)")
    return fallback_bf16.Storage(stochastic_rounding, seed, step or 1, index_base)


def _storage_args(master, states: dict, st: fallback_bf16.Storage | None) -> dict:
    if st is None:
        return {}
    state_dtype = next(iter(states.values())).dtype
    return dict(param_dtype=DTYPE_CODES[master.dtype], state_dtype=DTYPE_CODES[state_dtype],
                stochastic=st.stochastic, seed=st.seed, index_base=st.index_base)


def _out_args(out16) -> tuple[int, int]:
    return (0, NO_DTYPE) if out16 is None else (out16.data_ptr(), DTYPE_CODES[out16.dtype])


def adam_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
              weight_decay: float, step: int, adamw: bool, bias_correction: bool = True,
              grad_scale: float = 1.0, out16: torch.Tensor | None = None,
              impl: str | None = None, threads: int | None = None,
              stochastic_rounding: bool = False, seed: int = 0, index_base: int = 0) -> None:
    """One Adam (adamw=False: weight decay added to the gradient, torch.optim.Adam) or AdamW
    (adamw=True: decoupled decay, torch.optim.AdamW) update, in place."""
    states = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    n = _buffers(master, grad, states, out16)
    step = _check_step(step)
    st = _storage(master, states, stochastic_rounding, seed, step, index_base)
    h = dict(lr=_scalar("lr", lr), beta1=_scalar("beta1", beta1), beta2=_scalar("beta2", beta2),
             eps=_scalar("eps", eps), weight_decay=_scalar("weight_decay", weight_decay),
             grad_scale=_scalar("grad_scale", grad_scale))
    if n == 0:
        return
    chosen = resolve(impl, threads)
    if not chosen.native:
        if st is not None:
            fallback_bf16.adam_step(master, grad, exp_avg, exp_avg_sq, step=step, adamw=bool(adamw),
                                    bias_correction_on=bool(bias_correction), out16=out16,
                                    storage=st, **h)
            return
        fallback.adam_step(master, grad, exp_avg, exp_avg_sq, step=step, adamw=bool(adamw),
                           bias_correction_on=bool(bias_correction), out16=out16, **h)
        return
    out_ptr, out_code = _out_args(out16)
    native_module().adam(
        param=master.data_ptr(), grad=grad.data_ptr(), grad_dtype=DTYPE_CODES[grad.dtype],
        exp_avg=exp_avg.data_ptr(), exp_avg_sq=exp_avg_sq.data_ptr(), out16=out_ptr,
        out_dtype=out_code, n=n, step=step, adamw=bool(adamw),
        bias_correction=bool(bias_correction), isa=chosen.isa_code, threads=chosen.threads, **h,
        **_storage_args(master, states, st))


def adagrad_step(master: torch.Tensor, grad: torch.Tensor, state_sum: torch.Tensor, *, lr: float,
                 eps: float, weight_decay: float, step: int, lr_decay: float = 0.0,
                 grad_scale: float = 1.0, out16: torch.Tensor | None = None,
                 impl: str | None = None, threads: int | None = None,
                 stochastic_rounding: bool = False, seed: int = 0, index_base: int = 0) -> None:
    """One Adagrad update (torch.optim.Adagrad semantics, L2 weight decay), in place."""
    states = {"state_sum": state_sum}
    n = _buffers(master, grad, states, out16)
    step = _check_step(step)
    st = _storage(master, states, stochastic_rounding, seed, step, index_base)
    h = dict(lr=_scalar("lr", lr), lr_decay=_scalar("lr_decay", lr_decay), eps=_scalar("eps", eps),
             weight_decay=_scalar("weight_decay", weight_decay),
             grad_scale=_scalar("grad_scale", grad_scale))
    if n == 0:
        return
    chosen = resolve(impl, threads)
    if not chosen.native:
        if st is not None:
            fallback_bf16.adagrad_step(master, grad, state_sum, step=step, out16=out16, storage=st, **h)
            return
        fallback.adagrad_step(master, grad, state_sum, step=step, out16=out16, **h)
        return
    out_ptr, out_code = _out_args(out16)
    native_module().adagrad(
        param=master.data_ptr(), grad=grad.data_ptr(), grad_dtype=DTYPE_CODES[grad.dtype],
        state_sum=state_sum.data_ptr(), out16=out_ptr, out_dtype=out_code, n=n, step=step,
        isa=chosen.isa_code, threads=chosen.threads, **h, **_storage_args(master, states, st))


def lion_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float,
              beta1: float, beta2: float, weight_decay: float, grad_scale: float = 1.0,
              out16: torch.Tensor | None = None, impl: str | None = None,
              threads: int | None = None, stochastic_rounding: bool = False, seed: int = 0,
              index_base: int = 0, step: int | None = None) -> None:
    """One Lion update (decoupled weight decay), in place. Lion has no bias correction: `step`
    (1-based) is needed only to key stochastic rounding."""
    states = {"exp_avg": exp_avg}
    n = _buffers(master, grad, states, out16)
    if step is not None:
        step = _check_step(step)
    st = _storage(master, states, stochastic_rounding, seed, step, index_base)
    h = dict(lr=_scalar("lr", lr), beta1=_scalar("beta1", beta1), beta2=_scalar("beta2", beta2),
             weight_decay=_scalar("weight_decay", weight_decay),
             grad_scale=_scalar("grad_scale", grad_scale))
    if n == 0:
        return
    chosen = resolve(impl, threads)
    if not chosen.native:
        if st is not None:
            fallback_bf16.lion_step(master, grad, exp_avg, out16=out16, storage=st, **h)
            return
        fallback.lion_step(master, grad, exp_avg, out16=out16, **h)
        return
    out_ptr, out_code = _out_args(out16)
    native_module().lion(
        param=master.data_ptr(), grad=grad.data_ptr(), grad_dtype=DTYPE_CODES[grad.dtype],
        exp_avg=exp_avg.data_ptr(), out16=out_ptr, out_dtype=out_code, n=n,
        isa=chosen.isa_code, threads=chosen.threads, **h, **_storage_args(master, states, st),
        **({"step": st.step} if st is not None else {}))


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


# Elements per widened chunk in `accumulate`: 4 MiB of fp32, cache-sized (measured on this VM,
# 32M elements fp32 += bf16: 1.8 G elements/s at 64Ki, 3.0 at 256Ki, 3.3 at 1Mi, 3.7 at 4Mi).
ACCUMULATE_CHUNK = 1 << 20


def accumulate(dest: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dest += src, the same bits as `dest.add_(src)`: the sum in the wider of the two dtypes,
    rounded once to dest's.

    On the CPU torch's add_ of two dtypes runs unvectorized: 0.6-0.7 G elements/s for fp32 +=
    bf16 here, against 3.9 for fp32 += fp32 and 4.5 for the bf16 -> fp32 copy. Accumulating
    micro-steps' 16-bit gradient pieces into fp32 gradients (held, in files, host records) did
    that for every element and micro-step: at 3B, 2.6G elements x 3 micro-steps a step. So the
    narrower side goes through a chunk of the wider dtype first (exact: widening is), then
    one add of one dtype (3.0-3.7 G elements/s)."""
    wide = torch.promote_types(dest.dtype, src.dtype)
    if (dest.dtype == src.dtype or dest.device.type != "cpu" or src.device.type != "cpu"
            or wide not in (dest.dtype, src.dtype) or not dest.is_contiguous()
            or dest.shape != src.shape or dest.numel() < ACCUMULATE_CHUNK // 8):
        return dest.add_(src)
    d, s = dest.view(-1), src.reshape(-1)
    n = d.numel()
    tmp = torch.empty(min(n, ACCUMULATE_CHUNK), dtype=wide)
    for lo in range(0, n, ACCUMULATE_CHUNK):
        hi = min(n, lo + ACCUMULATE_CHUNK)
        t = tmp[:hi - lo]
        if wide == dest.dtype:  # widen the piece, add in dest's dtype
            t.copy_(s[lo:hi])
            d[lo:hi].add_(t)
        else:  # dest is the narrower: widen it, add, round once back
            t.copy_(d[lo:hi])
            t.add_(s[lo:hi])
            d[lo:hi].copy_(t)
    return dest
