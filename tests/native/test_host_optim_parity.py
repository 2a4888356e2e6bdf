"""Host kernels against torch (Adam, AdamW, Adagrad) and a reference Lion: 20 steps, a new lr every
step, odd lengths, every ISA of this CPU and the fallback, compared element-wise after each step."""
import pytest
import torch
from torch.testing import assert_close

from _host_optim_ref import (IMPLS, LENGTHS, RTOL, STEPS, RefLion, lrs, param_atol, state_atol)
from zerokit.optim import host


def _grads(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for _ in range(STEPS)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_adam_matches_torch(impl, n, adamw):
    gen = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=gen)
    ref = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([ref], lr=1.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)
    master, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step, (g, lr) in enumerate(zip(_grads(n, 1), lrs(1e-3)), start=1):
        opt.param_groups[0]["lr"] = lr
        ref.grad = g.clone()
        opt.step()
        host.adam_step(master, g, m, v, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8,
                       weight_decay=0.05, step=step, adamw=adamw, impl=impl)
        st = opt.state[ref]
        assert_close(master, ref.detach(), rtol=RTOL, atol=param_atol(lr), msg=lambda s: f"param, step {step}: {s}")
        assert_close(m, st["exp_avg"], rtol=RTOL, atol=state_atol(1.0), msg=lambda s: f"exp_avg, step {step}: {s}")
        assert_close(v, st["exp_avg_sq"], rtol=RTOL, atol=0.0, msg=lambda s: f"exp_avg_sq, step {step}: {s}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", LENGTHS)
def test_adagrad_matches_torch(impl, n):
    gen = torch.Generator().manual_seed(n + 1)
    p0 = torch.randn(n, generator=gen)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.Adagrad([ref], lr=1.0, lr_decay=0.01, weight_decay=0.02, eps=1e-10,
                              initial_accumulator_value=0.1)
    master, acc = p0.clone(), torch.full((n,), 0.1)
    for step, (g, lr) in enumerate(zip(_grads(n, 2), lrs(1e-2)), start=1):
        opt.param_groups[0]["lr"] = lr
        ref.grad = g.clone()
        opt.step()
        host.adagrad_step(master, g, acc, lr=lr, lr_decay=0.01, eps=1e-10, weight_decay=0.02,
                          step=step, impl=impl)
        assert_close(master, ref.detach(), rtol=RTOL, atol=param_atol(lr), msg=lambda s: f"param, step {step}: {s}")
        assert_close(acc, opt.state[ref]["sum"], rtol=RTOL, atol=0.0, msg=lambda s: f"sum, step {step}: {s}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", LENGTHS)
def test_lion_matches_reference(impl, n):
    gen = torch.Generator().manual_seed(n + 2)
    p0 = torch.randn(n, generator=gen)
    ref = RefLion(p0.clone(), beta1=0.9, beta2=0.99, weight_decay=0.1)
    master, m = p0.clone(), torch.zeros(n)
    for step, (g, lr) in enumerate(zip(_grads(n, 3), lrs(1e-4)), start=1):
        ref.step(g, lr)
        host.lion_step(master, g, m, lr=lr, beta1=0.9, beta2=0.99, weight_decay=0.1, impl=impl)
        assert_close(master, ref.p, rtol=RTOL, atol=param_atol(lr), msg=lambda s: f"param, step {step}: {s}")
        assert_close(m, ref.m, rtol=RTOL, atol=state_atol(1.0), msg=lambda s: f"exp_avg, step {step}: {s}")


@pytest.mark.parametrize("impl", IMPLS)
def test_adam_without_bias_correction_and_maximize(impl):
    n = 4099
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(n, generator=gen)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.Adam([ref], lr=1e-3, maximize=True)
    master, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step, g in enumerate(_grads(n, 6)[:5], start=1):
        ref.grad = g.clone()
        opt.step()
        # maximize is a negative gradient scale, exactly what torch does first
        host.adam_step(master, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                       weight_decay=0.0, step=step, adamw=False, grad_scale=-1.0, impl=impl)
    assert_close(master, ref.detach(), rtol=RTOL, atol=param_atol(1e-3))

    # Without bias correction the first step moves by lr * g*(1-b1) / (|g|*sqrt(1-b2) + eps).
    master, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    g = _grads(n, 7)[0]
    host.adam_step(master, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                   step=1, adamw=True, bias_correction=False, impl=impl)
    expected = p0 - 1e-3 * (0.1 * g) / ((0.001 * g * g).sqrt() + 1e-8)
    assert_close(master, expected, rtol=1e-5, atol=1e-9)
