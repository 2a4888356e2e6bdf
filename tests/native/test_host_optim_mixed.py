"""Fused mixed precision: 16-bit gradients in, scale applied inside, fp32 master/state updated,
16-bit weights out, against the torch composition (upcast, unscale, step, downcast)."""
import pytest
import torch
from torch.testing import assert_close

from _host_optim_ref import IMPLS, RTOL, RefLion, assert_within_one_ulp16, param_atol, state_atol
from zerokit.optim import host

DT16 = [torch.bfloat16, torch.float16]
N = 100_003


def _setup(seed: int, gdtype):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(N, generator=gen)
    # Gradients as a loss-scaled 16-bit backward would leave them (scale 1024).
    grads = [(torch.randn(N, generator=gen) * 1024).to(gdtype) for _ in range(6)]
    return p0, grads


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gdtype", DT16, ids=["g_bf16", "g_f16"])
@pytest.mark.parametrize("odtype", DT16, ids=["o_bf16", "o_f16"])
def test_adamw_mixed_matches_composition(impl, gdtype, odtype):
    p0, grads = _setup(1, gdtype)
    scale = 0.7 / 1024  # clip coefficient / loss scale
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=2e-3, weight_decay=0.01)
    master, m, v = p0.clone(), torch.zeros(N), torch.zeros(N)
    out = torch.empty(N, dtype=odtype)
    for step, g16 in enumerate(grads, start=1):
        ref.grad = g16.float().mul_(scale)      # upcast, unscale x clip
        opt.step()                              # fp32 step
        expected16 = ref.detach().to(odtype)    # downcast
        host.adam_step(master, g16, m, v, lr=2e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                       weight_decay=0.01, step=step, adamw=True, grad_scale=scale, out16=out,
                       impl=impl)
        assert_close(master, ref.detach(), rtol=RTOL, atol=param_atol(2e-3))
        assert_close(m, opt.state[ref]["exp_avg"], rtol=RTOL, atol=state_atol(1.0))
        assert_within_one_ulp16(out, expected16)
        # and out16 is exactly the kernel's own master, rounded as torch rounds
        assert torch.equal(out, master.to(odtype))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gdtype", DT16, ids=["g_bf16", "g_f16"])
def test_adagrad_and_lion_mixed(impl, gdtype):
    p0, grads = _setup(2, gdtype)
    scale = 1 / 1024
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.Adagrad([ref], lr=1e-2)
    lion = RefLion(p0.clone(), 0.9, 0.99, 0.1)
    ma, acc, ml, ml_m = p0.clone(), torch.zeros(N), p0.clone(), torch.zeros(N)
    out_a, out_l = torch.empty(N, dtype=torch.bfloat16), torch.empty(N, dtype=torch.float16)
    for step, g16 in enumerate(grads, start=1):
        g = g16.float().mul_(scale)
        ref.grad = g
        opt.step()
        lion.step(g, 1e-4)
        host.adagrad_step(ma, g16, acc, lr=1e-2, eps=1e-10, weight_decay=0.0, step=step,
                          grad_scale=scale, out16=out_a, impl=impl)
        host.lion_step(ml, g16, ml_m, lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1,
                       grad_scale=scale, out16=out_l, impl=impl)
        assert_close(ma, ref.detach(), rtol=RTOL, atol=param_atol(1e-2))
        assert_within_one_ulp16(out_a, ref.detach().to(torch.bfloat16))
        assert_close(ml, lion.p, rtol=RTOL, atol=param_atol(1e-4))
        assert_within_one_ulp16(out_l, lion.p.to(torch.float16))


def _special_values(dtype_out):
    """fp32 values that stress narrowing: ties, subnormals, overflow, signed zeros, inf, NaN."""
    base = torch.tensor([0.0, -0.0, 1.0, -1.0, 65504.0, 65520.0, 1e6, -1e30, 3.0e38,
                         float("inf"), float("-inf"), float("nan"), 1e-40, -1e-45, 6e-8, 3e-5,
                         1.00390625, 1.01171875, 1.0009765625, 1.0029296875])
    gen = torch.Generator().manual_seed(3)
    rnd = torch.randn(5000, generator=gen) * torch.logspace(-40, 38, 5000)
    # random bit patterns cover every exponent and the rounding bits exhaustively enough
    bits = torch.randint(-(2**31), 2**31 - 1, (20000,), generator=gen, dtype=torch.int64)
    return torch.cat([base, rnd, bits.to(torch.int32).view(torch.float32)])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("odtype", DT16, ids=["bf16", "f16"])
def test_narrowing_is_torchs_round_to_nearest_even(impl, odtype):
    # lr=0 and no decay leave the master untouched, so out16 is just the narrowing of it.
    master = _special_values(odtype)
    n = master.numel()
    out = torch.empty(n, dtype=odtype)
    host.lion_step(master.clone(), torch.zeros(n), torch.zeros(n), lr=0.0, beta1=0.9, beta2=0.99,
                   weight_decay=0.0, out16=out, impl=impl)
    expected = master.to(odtype)
    same = (out.view(torch.int16) == expected.view(torch.int16)) | (out.isnan() & expected.isnan())
    bad = (~same).nonzero().flatten()[:5].tolist()
    assert not bad, [(master[i].item(), out[i].item(), expected[i].item()) for i in bad]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gdtype", DT16, ids=["bf16", "f16"])
def test_widening_is_exact_for_every_16bit_value(impl, gdtype):
    g16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(gdtype)
    n = g16.numel()
    # Lion with beta2 = 0 stores exp_avg = g * 1 + m * 0 = g: the widened gradient itself.
    m = torch.zeros(n)
    host.lion_step(torch.zeros(n), g16, m, lr=0.0, beta1=0.9, beta2=0.0, weight_decay=0.0, impl=impl)
    assert_close(m, g16.float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "fallback"])
def test_thread_count_does_not_change_results(impl):
    n = 3_000_017
    gen = torch.Generator().manual_seed(4)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.bfloat16)
    results = []
    for threads in (1, 2, 3):
        master, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=torch.float16)
        for step in (1, 2):
            host.adam_step(master, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                           weight_decay=0.1, step=step, adamw=True, grad_scale=0.5, out16=out,
                           impl=impl, threads=threads)
        results.append((master, m, v, out))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "fallback"])
@pytest.mark.parametrize("odtype", DT16, ids=["bf16", "f16"])
def test_unaligned_output_gives_the_same_bits(impl, odtype):
    # An aligned out16 takes the non-temporal store path, an offset view the ordinary one.
    n = 70_001
    gen = torch.Generator().manual_seed(8)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.float16)
    outs = []
    for offset in (0, 1, 3):
        out = torch.empty(n + offset, dtype=odtype)[offset:]
        master, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        host.adam_step(master, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                       weight_decay=0.0, step=1, adamw=True, out16=out, impl=impl)
        outs.append(out)
        assert torch.equal(out, master.to(odtype))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
