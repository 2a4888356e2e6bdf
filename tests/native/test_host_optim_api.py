"""Optimizer classes as drop-ins, state dicts, the fallback switch, kernel_info, and errors."""
import copy
import shutil
import warnings

import pytest
import torch
from torch.testing import assert_close

from _host_optim_ref import IMPLS, RTOL, param_atol
from zerokit.optim import HostAdagrad, HostAdam, HostLion, available_isas, backend, host, kernel_info


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.GELU(), torch.nn.Linear(31, 7))


def _train(model, opt, sched=None, steps=8):
    gen = torch.Generator().manual_seed(9)
    for _ in range(steps):
        x, y = torch.randn(5, 13, generator=gen), torch.randn(5, 7, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if sched is not None:
            sched.step()


def test_native_extension_is_built_where_a_compiler_exists():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the fallback is the expected path")
    assert backend.native_module() is not None, kernel_info()
    assert kernel_info(impl="native")["backend"] == "native"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_host_adam_is_a_drop_in_with_scheduler(impl, adamw_mode):
    ref_model, model = _model(), _model()
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref_opt = cls([{"params": ref_model[0].parameters()}, {"params": ref_model[2].parameters(), "lr": 3e-3}],
                  lr=1e-3, weight_decay=0.02)
    opt = HostAdam([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 3e-3}],
                   lr=1e-3, weight_decay=0.02, adamw_mode=adamw_mode, impl=impl)
    lam = lambda s: 1.0 / (1 + s)
    _train(ref_model, ref_opt, torch.optim.lr_scheduler.LambdaLR(ref_opt, lam))
    _train(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lam))
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert_close(a, b, rtol=RTOL, atol=param_atol(3e-3))


def test_state_dict_moves_between_host_adam_and_torch_adamw():
    model, ref_model = _model(), _model()
    opt = HostAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, weight_decay=0.01)
    _train(model, opt, steps=3)
    _train(ref_model, ref_opt, steps=3)
    # resume each from the other's state: step count and moments carry over
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    for p, rp in zip(model.parameters(), ref_model.parameters()):
        p.data.copy_(rp.data)
    _train(model, opt, steps=3)
    _train(ref_model, ref_opt, steps=3)
    assert int(opt.state[next(model.parameters())]["step"]) == 6
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert_close(a, b, rtol=RTOL, atol=param_atol(1e-3))


@pytest.mark.parametrize("impl", IMPLS)
def test_host_adagrad_and_lion_classes(impl):
    ref_model, model = _model(1), _model(1)
    ref_opt = torch.optim.Adagrad(ref_model.parameters(), lr=1e-2, lr_decay=1e-3,
                                  initial_accumulator_value=0.05, maximize=True)
    opt = HostAdagrad(model.parameters(), lr=1e-2, lr_decay=1e-3, initial_accumulator_value=0.05,
                      maximize=True, impl=impl)
    _train(ref_model, ref_opt)
    _train(model, opt)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert_close(a, b, rtol=RTOL, atol=param_atol(1e-2))

    lion_model = _model(2)
    before = [p.detach().clone() for p in lion_model.parameters()]
    lion = HostLion(lion_model.parameters(), lr=1e-3, weight_decay=0.1, impl=impl)
    _train(lion_model, lion, steps=1)
    for b, p in zip(before, lion_model.parameters()):
        # first step: m = 0, so update = sign(g) and p = p*(1 - lr*wd) - lr*sign(g)
        expected = b * (1 - 1e-3 * 0.1) - 1e-3 * p.grad.sign()
        assert_close(p.detach(), expected, rtol=RTOL, atol=1e-9)


def test_non_contiguous_parameter_is_stepped_in_place():
    w = torch.randn(17, 9)
    p = torch.nn.Parameter(w.t())  # strided
    ref = torch.nn.Parameter(w.t().clone())
    opt, ref_opt = HostAdam([p], lr=1e-2), torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.0)
    g = torch.randn(9, 17)
    p.grad, ref.grad = g.clone(), g.clone()
    opt.step()
    ref_opt.step()
    assert not p.is_contiguous()
    assert_close(p.detach(), ref.detach(), rtol=RTOL, atol=param_atol(1e-2))


def test_forced_fallback_gives_the_native_numbers(monkeypatch):
    if not available_isas():
        pytest.skip("native extension not built")
    n = 200_003
    gen = torch.Generator().manual_seed(11)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.bfloat16)
    outs = {}
    for forced in ("0", "1"):
        monkeypatch.setenv("ZEROKIT_FORCE_FALLBACK", forced)
        assert kernel_info()["backend"] == ("fallback" if forced == "1" else "native")
        master, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=torch.bfloat16)
        for step in range(1, 6):
            host.adam_step(master, g, m, v, lr=1e-3 * step, beta1=0.9, beta2=0.95, eps=1e-6,
                           weight_decay=0.1, step=step, adamw=True, grad_scale=0.25, out16=out)
        outs[forced] = (master, m, v, out)
    (pn, mn, vn, on), (pf, mf, vf, of) = outs["0"], outs["1"]
    assert_close(pf, pn, rtol=RTOL, atol=param_atol(5e-3))
    assert_close(mf, mn, rtol=RTOL, atol=1e-7)
    assert_close(vf, vn, rtol=RTOL, atol=0.0)
    assert (on.float() - of.float()).abs().max() <= 2 ** -7 * of.float().abs().max()


def test_isa_env_var_and_bias_correction_reproducible(monkeypatch):
    if not available_isas():
        pytest.skip("native extension not built")
    monkeypatch.setenv("ZEROKIT_HOST_ISA", "scalar")
    assert kernel_info() == kernel_info(impl="scalar")
    assert kernel_info()["isa"] == "scalar"
    monkeypatch.setenv("ZEROKIT_HOST_ISA", "sse9")
    with pytest.raises(ValueError, match="ZEROKIT_HOST_ISA='sse9'"):
        kernel_info()
    mod = backend.native_module()
    for beta in (0.9, 0.95, 0.98, 0.999, 0.9999):
        for step in list(range(1, 3000)) + [10**5, 10**6 + 7]:
            assert mod.bias_correction(beta, step) == host.bias_correction(beta, step)


def test_missing_extension_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setattr(backend, "_loaded", True)
    monkeypatch.setattr(backend, "_native", None)
    monkeypatch.setattr(backend, "_native_error", "simulated: no compiler")
    monkeypatch.setattr(backend, "_warned", False)
    monkeypatch.delenv("ZEROKIT_FORCE_FALLBACK", raising=False)
    monkeypatch.delenv("ZEROKIT_HOST_ISA", raising=False)
    with pytest.warns(RuntimeWarning, match="simulated: no compiler"):
        assert kernel_info()["backend"] == "fallback"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel_info()["backend"] == "fallback"
    with pytest.raises(RuntimeError, match="not built"):
        kernel_info(impl="avx2")


def test_kernel_info_threads_follow_torch(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert kernel_info()["threads"] == 3
    assert kernel_info(threads=1)["threads"] == 1


def _bufs(n=10, **over):
    b = dict(master=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n),
             exp_avg_sq=torch.zeros(n))
    b.update(over)
    return b


HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, adamw=True)


@pytest.mark.parametrize("over, kw, match", [
    (dict(grad=torch.zeros(11)), {}, "grad has 11 elements but master has 10"),
    (dict(exp_avg=torch.zeros(10, dtype=torch.float64)), {}, "exp_avg has dtype float64; allowed: float32, bfloat16"),
    (dict(exp_avg=torch.zeros(10, dtype=torch.bfloat16)), {},
     "optimizer states must share one dtype; got exp_avg=bfloat16, exp_avg_sq=float32"),
    ({}, dict(stochastic_rounding=True), "stochastic_rounding=True needs a bf16 master or bf16 optimizer states"),
    (dict(master=torch.zeros(10, dtype=torch.bfloat16)), dict(seed=-1), r"seed=-1 must be an int in \[0, 2\*\*64\)"),
    (dict(master=torch.zeros(10, dtype=torch.bfloat16)), dict(index_base=-5), "index_base=-5 must be an int >= 0"),
    (dict(grad=torch.zeros(10, dtype=torch.int32)), {}, "grad has dtype int32; allowed: float32, bfloat16, float16"),
    (dict(master=torch.zeros(20)[::2]), {}, r"master \(shape \(10,\), strides \(2,\)\) is not contiguous"),
    (dict(exp_avg_sq=torch.zeros(10, device="meta")), {}, "exp_avg_sq is on meta"),
    ({}, dict(out16=torch.zeros(10)), "out16 has dtype float32; allowed: bfloat16, float16"),
    ({}, dict(step=0), "step=0 must be an int >= 1"),
    ({}, dict(lr=float("nan")), "lr=nan must be finite"),
    ({}, dict(impl="avx1024"), "impl='avx1024' is not one of"),
    ({}, dict(threads=0), "threads=0 must be a positive int"),
])
def test_errors_name_argument_value_and_allowed(over, kw, match):
    with pytest.raises(ValueError, match=match):
        host.adam_step(**_bufs(**over), **{**HYPER, **kw})


def test_optimizer_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="amsgrad"):
        HostAdam([torch.nn.Parameter(torch.zeros(3))], amsgrad=True)
    with pytest.raises(ValueError, match=r"betas\[1\]=1.0 must be in \[0.0, 1.0\)"):
        HostAdam([torch.nn.Parameter(torch.zeros(3))], betas=(0.9, 1.0))
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    p.grad = torch.zeros(3, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"fp32 or bf16 CPU parameters; param_groups\[0\]\['params'\]\[0\] \(shape \(3,\)\) is torch.float16"):
        HostAdam([p]).step()
