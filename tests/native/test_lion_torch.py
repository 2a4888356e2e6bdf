"""zerokit.optim.Lion (torch ops, any device) against an independent scalar Lion and against the
native host kernel: 20 steps, a new lr every step, odd lengths, several tensors in one group,
weight decay on and off, maximize; element-wise after every step. On a CUDA machine the same
comparisons run with the torch Lion on the GPU."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.testing import assert_close

from _host_optim_ref import IMPLS, RTOL, STEPS, lrs, param_atol, state_atol
from zerokit.optim import Lion, host

SHAPES = [(1,), (7,), (33, 31), (1023,)]  # odd lengths (SIMD tails), a 2-D parameter
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def scalar_lion(p: list[float], m: list[float], g: list[float], *, lr: float, beta1: float, beta2: float,
                weight_decay: float, maximize: bool) -> None:
    """Lion as published (Chen et al. 2023, Algorithm 2), one Python float at a time."""
    for i in range(len(p)):
        gi = -g[i] if maximize else g[i]
        c = beta1 * m[i] + (1 - beta1) * gi
        p[i] = p[i] * (1 - lr * weight_decay) - lr * (math.copysign(1.0, c) if c != 0 else 0.0)
        m[i] = beta2 * m[i] + (1 - beta2) * gi


def _problem(seed: int):
    gen = torch.Generator().manual_seed(seed)
    p0 = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(STEPS)]
    return p0, grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weight_decay,maximize", [(0.1, False), (0.0, False), (0.3, True)])
def test_torch_lion_matches_scalar_reference(device: str, weight_decay: float, maximize: bool) -> None:
    p0, grads = _problem(11)
    params = [torch.nn.Parameter(p.clone().to(device)) for p in p0]
    opt = Lion(params, lr=1.0, betas=(0.9, 0.99), weight_decay=weight_decay, maximize=maximize)
    ref_p = [p.reshape(-1).tolist() for p in p0]  # Python floats: double precision
    ref_m = [[0.0] * p.numel() for p in p0]
    for step, (g, lr) in enumerate(zip(grads, lrs(1e-3)), start=1):
        opt.param_groups[0]["lr"] = lr
        for p, gi in zip(params, g):
            p.grad = gi.to(device)
        opt.step()
        for i, gi in enumerate(g):
            scalar_lion(ref_p[i], ref_m[i], gi.reshape(-1).tolist(), lr=lr, beta1=0.9, beta2=0.99,
                        weight_decay=weight_decay, maximize=maximize)
        for i, p in enumerate(params):
            want = torch.tensor(ref_p[i], dtype=torch.float64).view(p.shape)
            assert_close(p.detach().cpu().double(), want, rtol=RTOL, atol=param_atol(lr),
                         msg=lambda s: f"param {i}, step {step}: {s}")
            assert_close(opt.state[p]["exp_avg"].cpu().double(), torch.tensor(ref_m[i], dtype=torch.float64).view(p.shape),
                         rtol=RTOL, atol=state_atol(1.0), msg=lambda s: f"exp_avg {i}, step {step}: {s}")
        assert all(int(opt.state[p]["step"]) == step for p in params)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("weight_decay", [0.1, 0.0])
def test_torch_lion_matches_host_kernel(device: str, impl: str, weight_decay: float) -> None:
    """The device part (torch) and the host part (native kernel) of a Twin-Flow split must step
    alike; the host kernel also folds a gradient scale in, which the engine multiplies into the
    device gradient first."""
    p0, grads = _problem(12)
    params = [torch.nn.Parameter(p.clone().to(device)) for p in p0]
    opt = Lion(params, lr=1.0, betas=(0.9, 0.99), weight_decay=weight_decay)
    masters = [p.clone().reshape(-1) for p in p0]
    moms = [torch.zeros(p.numel()) for p in p0]
    coef = 0.37
    for step, (g, lr) in enumerate(zip(grads, lrs(1e-4)), start=1):
        opt.param_groups[0]["lr"] = lr
        for p, gi in zip(params, g):
            p.grad = gi.to(device) * coef
        opt.step()
        for master, m, gi in zip(masters, moms, g):
            host.lion_step(master, gi.reshape(-1), m, lr=lr, beta1=0.9, beta2=0.99,
                           weight_decay=weight_decay, grad_scale=coef, impl=impl)
        for i, p in enumerate(params):
            assert_close(p.detach().cpu().reshape(-1), masters[i], rtol=RTOL, atol=param_atol(lr),
                         msg=lambda s: f"param {i}, step {step}: {s}")
            assert_close(opt.state[p]["exp_avg"].cpu().reshape(-1), moms[i], rtol=RTOL,
                         atol=state_atol(coef), msg=lambda s: f"exp_avg {i}, step {step}: {s}")


def test_torch_lion_state_dict_moves_to_host_lion() -> None:
    """Same state keys as HostLion: a state dict saved from one loads into the other."""
    from zerokit.optim import HostLion

    p0, grads = _problem(13)
    a = [torch.nn.Parameter(p.clone()) for p in p0]
    b = [torch.nn.Parameter(p.clone()) for p in p0]
    torch_lion, host_lion = Lion(a, lr=1e-3, weight_decay=0.1), HostLion(b, lr=1e-3, weight_decay=0.1)
    for p, q, g in zip(a, b, grads[0]):
        p.grad, q.grad = g.clone(), g.clone()
    torch_lion.step()
    host_lion.step()
    assert {k for st in torch_lion.state.values() for k in st} == {k for st in host_lion.state.values() for k in st}
    host_lion.load_state_dict(copy.deepcopy(torch_lion.state_dict()))  # not sharing exp_avg
    for p, q, g in zip(a, b, grads[1]):
        p.grad, q.grad = g.clone(), g.clone()
    torch_lion.step()
    host_lion.step()
    for p, q in zip(a, b):
        assert_close(p.detach(), q.detach(), rtol=RTOL, atol=param_atol(1e-3))


def test_torch_lion_rejects_bad_hyper_parameters() -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=r"Lion: betas\[1\]=1.0 must be in \[0.0, 1.0\)"):
        Lion(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="Lion: lr=-1 must be >= 0.0"):
        Lion(p, lr=-1)
