"""Host kernels with bf16 master weights and/or bf16 optimizer states (issue #27).

- every native ISA and the torch fallback give the same bits (Adam/AdamW, Adagrad, Lion; every
  storage combination; round-to-nearest and stochastic rounding; odd lengths and thread splits);
- round-to-nearest equals a float64 reference rounded once to bf16 (to the last bit wherever the
  fp32 math cannot straddle a rounding boundary);
- stochastic rounding is unbiased (the mean of many roundings is the fp32 value) and moves a bf16
  master by updates far below half an ulp, as an SGD-like fp32 master does, where round-to-nearest
  stalls; and it is reproducible from (seed, step, index), whatever the thread split or sub-group.
"""
import pytest
import torch

from _host_optim_ref import IMPLS, ordered_bits16
from zerokit.optim import host, rounding

BF16, F32 = torch.bfloat16, torch.float32
STORAGE = [(BF16, F32), (BF16, BF16), (F32, BF16)]  # (master, states)
STORAGE_IDS = ["master_bf16", "all_bf16", "states_bf16"]
LENGTHS = [1, 7, 1023, 100_003]  # SIMD tails; the large one spans threads


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == BF16 else t.view(torch.int32)


def _run(opt: str, impl: str, n: int, master_dtype, state_dtype, *, stochastic: bool, steps: int = 4,
         threads=None, seed: int = 11, index_base: int = 1000, gdtype=BF16, wd: float = 0.01):
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen).to(master_dtype)
    grads = [(torch.randn(n, generator=gen) * 1024).to(gdtype) for _ in range(steps)]
    states = [torch.rand(n, generator=gen).to(state_dtype) for _ in range(2)]  # non-zero moments
    out = torch.empty(n, dtype=BF16)
    kw = dict(out16=out, impl=impl, threads=threads, stochastic_rounding=stochastic, seed=seed,
              index_base=index_base, grad_scale=0.7 / 1024)
    for step, g in enumerate(grads, start=1):
        lr = 1e-3 * (1 + 0.3 * step)
        if opt in ("adam", "adamw"):
            host.adam_step(p, g, states[0], states[1], lr=lr, beta1=0.9, beta2=0.999, eps=1e-8,
                           weight_decay=wd, step=step, adamw=opt == "adamw", **kw)
        elif opt == "adagrad":
            host.adagrad_step(p, g, states[0], lr=lr, lr_decay=0.01, eps=1e-10, weight_decay=wd,
                              step=step, **kw)
        else:
            host.lion_step(p, g, states[0], lr=lr / 10, beta1=0.9, beta2=0.99, weight_decay=wd,
                           step=step, **kw)
    used = states if opt in ("adam", "adamw") else states[:1]
    return [p, *used, out]


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("storage", STORAGE, ids=STORAGE_IDS)
@pytest.mark.parametrize("opt", ["adam", "adamw", "adagrad", "lion"])
@pytest.mark.parametrize("n", LENGTHS)
def test_every_isa_and_the_fallback_give_the_same_bits(n, opt, storage, stochastic):
    results = {impl: _run(opt, impl, n, *storage, stochastic=stochastic) for impl in IMPLS}
    ref = results["fallback"]
    for impl, got in results.items():
        names = ["master"] + [f"state{i}" for i in range(len(got) - 2)] + ["out16"]
        for name, a, b in zip(names, got, ref):
            diff = int((_bits(a) != _bits(b)).sum())
            assert diff == 0, f"{impl} vs fallback: {name} differs in {diff} of {n} elements"


@pytest.mark.parametrize("gdtype", [F32, torch.float16], ids=["g_f32", "g_f16"])
def test_other_gradient_dtypes_agree_too(gdtype):
    results = {impl: _run("adamw", impl, 1023, BF16, BF16, stochastic=True, gdtype=gdtype) for impl in IMPLS}
    for impl, got in results.items():
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, results["fallback"])), impl


def test_bf16_master_out16_is_the_master_itself():
    p, _, _, out = _run("adamw", IMPLS[0], 1023, BF16, BF16, stochastic=True)
    assert torch.equal(out.view(torch.int16), p.view(torch.int16))
    # and an fp16 output is the bf16 master rounded once more to fp16
    n = 1023
    p = torch.randn(n).to(BF16)
    m, v, out = torch.zeros(n, dtype=BF16), torch.zeros(n, dtype=BF16), torch.empty(n, dtype=torch.float16)
    host.adam_step(p, torch.randn(n), m, v, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                   weight_decay=0.0, step=1, adamw=True, out16=out)
    assert torch.equal(out, p.to(torch.float16))


@pytest.mark.parametrize("impl", IMPLS)
def test_round_to_nearest_matches_a_float64_reference(impl):
    """One AdamW step from bf16 master and bf16 moments, against the same update in float64 from
    the same (widened) inputs, rounded once to bf16."""
    n = 200_003
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(n, generator=gen).to(BF16)
    m = (torch.randn(n, generator=gen) * 0.1).to(BF16)
    v = (torch.rand(n, generator=gen) * 0.01 + 1e-4).to(BF16)
    g = torch.randn(n, generator=gen)
    lr, b1, b2, eps, wd, step = 1e-2, 0.9, 0.999, 1e-8, 0.1, 7
    P, M, V, G = (t.double() for t in (p, m, v, g))
    M = b1 * M + (1 - b1) * G
    V = b2 * V + (1 - b2) * G * G
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    P = P * (1 - lr * wd) - (lr / bc1) * M / (V.sqrt() / bc2 ** 0.5 + eps)
    host.adam_step(p, g, m, v, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, step=step,
                   adamw=True, impl=impl)
    for name, got, exact in (("master", p, P), ("exp_avg", m, M), ("exp_avg_sq", v, V)):
        want = exact.to(BF16)  # one rounding, float64 -> bf16, nearest even
        dist = (ordered_bits16(got) - ordered_bits16(want)).abs()
        assert int(dist.max()) <= 1, f"{name}: {int(dist.max())} ulp from the float64 reference"
        # fp32 math is ~2**-16 bf16 ulp off the exact value: only values that land within that
        # of a rounding boundary may round the other way.
        assert float((dist != 0).float().mean()) < 1e-3, f"{name}: {int((dist != 0).sum())} of {n} differ"


def test_stochastic_rounding_is_unbiased():
    """Each fp32 value rounded under 4096 keys: the mean is the value (to sampling noise), while
    round-to-nearest is off by up to half an ulp."""
    x = torch.tensor([1.0 + k * 2 ** -7 / 16 for k in range(16)] + [-3.3, 1e-3, 7.77e4], dtype=F32)
    rounds = torch.stack([rounding.to_bf16(x, stochastic=True, key=rounding.sr_key(5, s, 0)).float()
                          for s in range(4096)])
    ulp = (x.to(BF16).float().abs() * 2 ** -7).clamp_min(2 ** -133)
    mean_err = (rounds.mean(0) - x).abs() / ulp
    # each round is one of two neighbours an ulp apart: std of the mean <= 0.5 / sqrt(4096) ulp
    assert float(mean_err.max()) < 5 * 0.5 / 64, mean_err
    assert all(len(torch.unique(rounds[:, i])) <= 2 for i in range(x.numel()))
    rtn_err = (x.to(BF16).float() - x).abs() / ulp
    assert float(rtn_err.max()) > 0.4  # round-to-nearest is biased on these


@pytest.mark.parametrize("impl", IMPLS)
def test_stochastic_rounding_keeps_updates_below_half_an_ulp(impl):
    """SGD-like check where scale matters: Adagrad with a constant gradient moves every parameter
    by exactly -lr/(1+eps) per step in fp32; at 1.0 that is 1/16 of a bf16 ulp. Round-to-nearest
    never moves the bf16 master; stochastic rounding moves it by the fp32 amount on average."""
    n, steps, lr = 65_536, 40, 2 ** -7 / 16
    g = torch.ones(n)

    def run(master_dtype, stochastic):
        p, acc = torch.ones(n, dtype=master_dtype), torch.zeros(n)
        for step in range(1, steps + 1):
            host.adagrad_step(p, g, acc.fill_(0.0), lr=lr, eps=0.0, weight_decay=0.0, step=step,
                              impl=impl, stochastic_rounding=stochastic, seed=1)
        return p.float()

    fp32 = run(F32, False)
    assert torch.allclose(fp32, torch.full((n,), 1.0 - steps * lr))
    assert torch.equal(run(BF16, False), torch.ones(n))  # round-to-nearest stalls
    sr = run(BF16, True)
    moved, want = 1.0 - float(sr.mean()), steps * lr
    assert abs(moved - want) < 0.02 * want, (moved, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_stochastic_rounding_is_reproducible_and_split_independent(impl):
    n = 100_003
    one = _run("adamw", impl, n, BF16, BF16, stochastic=True, threads=1)
    two = _run("adamw", impl, n, BF16, BF16, stochastic=True, threads=2)
    again = _run("adamw", impl, n, BF16, BF16, stochastic=True, threads=2)
    other_seed = _run("adamw", impl, n, BF16, BF16, stochastic=True, seed=12)
    for a, b, c in zip(one, two, again):
        assert torch.equal(_bits(a), _bits(b)) and torch.equal(_bits(b), _bits(c))
    assert not torch.equal(_bits(one[0]), _bits(other_seed[0]))


@pytest.mark.parametrize("impl", IMPLS)
def test_sub_groups_with_their_index_base_equal_one_call(impl):
    """A shard stepped in two sub-groups (as the NVMe executor does), each with its offset as
    index_base, draws the same bits as one call over the whole shard."""
    n, cut, base = 10_007, 4_099, 123_456
    gen = torch.Generator().manual_seed(4)
    p0, g = torch.randn(n, generator=gen).to(BF16), torch.randn(n, generator=gen)
    whole = [p0.clone(), torch.zeros(n, dtype=BF16), torch.zeros(n, dtype=BF16)]
    parts = [p0.clone(), torch.zeros(n, dtype=BF16), torch.zeros(n, dtype=BF16)]
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=3, adamw=True,
                 impl=impl, stochastic_rounding=True, seed=9)
    host.adam_step(whole[0], g, whole[1], whole[2], index_base=base, **hyper)
    for s in (slice(0, cut), slice(cut, n)):
        host.adam_step(parts[0][s], g[s], parts[1][s], parts[2][s], index_base=base + s.start, **hyper)
    for a, b in zip(whole, parts):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_keys_match_the_native_hash():
    from zerokit.optim.backend import native_module

    mod = native_module()
    if mod is None:
        pytest.skip("native extension not built")
    for seed, step, buf in [(0, 1, 0), (2 ** 64 - 1, 2 ** 40 + 3, 2), (123456789, 77, 1)]:
        assert mod.stochastic_key(seed=seed, step=step, buffer=buf) == rounding.sr_key(seed, step, buf)


@pytest.mark.parametrize("fp32_states", [True, False])
def test_deepspeed_cpu_adam_on_bf16_parameters(fp32_states):
    """DeepSpeedCPUAdam on bf16 parameters (its own use outside an engine): moments in fp32, or
    bf16 with fp32_optimizer_states=False; against torch's AdamW in fp32 on widened copies,
    rounded once to bf16 per step (moments too when they are bf16)."""
    from zerokit.compat.deepspeed.ops.adam import DeepSpeedCPUAdam

    gen = torch.Generator().manual_seed(8)
    p = torch.nn.Parameter(torch.randn(4099, generator=gen).to(BF16))
    shadow = torch.nn.Parameter(p.detach().float())
    opt = DeepSpeedCPUAdam([p], lr=1e-2, weight_decay=0.1, fp32_optimizer_states=fp32_states)
    ref = torch.optim.AdamW([shadow], lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(5):
        g = torch.randn(4099, generator=gen)
        p.grad, shadow.grad = g.to(BF16), g.to(BF16).float()
        opt.step()
        with torch.no_grad():
            shadow.copy_(shadow.to(BF16).float())
            ref.step()
            if not fp32_states:
                for t in (ref.state[shadow]["exp_avg"], ref.state[shadow]["exp_avg_sq"]):
                    t.copy_(t.to(BF16).float())
            shadow.copy_(shadow.to(BF16).float())
        want = shadow.detach().to(BF16)
        dist = (ordered_bits16(p.detach()) - ordered_bits16(want)).abs()
        assert int(dist.max()) <= 1 and float((dist != 0).float().mean()) < 5e-3
    assert {t.dtype for t in opt.state[p].values() if t.dim()} == {F32 if fp32_states else BF16}


# ---- the device part's kernels (optim/device_kernels.py) --------------------------------------
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("storage", STORAGE, ids=STORAGE_IDS)
@pytest.mark.parametrize("opt", ["adam", "adamw", "adagrad", "lion"])
@pytest.mark.parametrize("n", [7, 1023, 100_003])
def test_device_kernels_give_the_host_kernels_bits(n, opt, storage, stochastic, monkeypatch):
    """A bf16 device part (no offload, Twin-Flow) steps through device_kernels: host.py's
    signature on any device, fallback_bf16's math. Same bits as the native kernel."""
    from zerokit.optim import device_kernels

    native = _run(opt, IMPLS[0], n, *storage, stochastic=stochastic)
    calls = []

    def through_device_kernels(name):
        def step(*args, impl=None, threads=None, **kw):  # device_kernels takes no impl / threads
            calls.append(name)
            getattr(device_kernels, name)(*args, **kw)
        return step

    for name in ("adam_step", "adagrad_step", "lion_step"):
        monkeypatch.setattr(host, name, through_device_kernels(name))
    got = _run(opt, "native", n, *storage, stochastic=stochastic)
    assert calls, "the device kernels were not called"
    names = ["master"] + [f"state{i}" for i in range(len(got) - 2)] + ["out16"]
    for name, a, b in zip(names, got, native):
        diff = int((_bits(a) != _bits(b)).sum())
        assert diff == 0, f"device_kernels vs {IMPLS[0]}: {name} differs in {diff} of {n} elements"


def test_device_kernels_refuse_an_all_fp32_step_and_bad_buffers():
    from zerokit.optim import device_kernels

    p, g = torch.zeros(8), torch.zeros(8)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, adamw=True)
    with pytest.raises(ValueError, match="every buffer is fp32"):
        device_kernels.adam_step(p, g, torch.zeros(8), torch.zeros(8), **kw)
    with pytest.raises(ValueError, match="contiguous fp32/bf16 tensor of 8 elements"):
        device_kernels.adam_step(p.to(BF16), g, torch.zeros(7), torch.zeros(8), **kw)


def test_stochastic_bits_are_made_on_the_tensor_device():
    x = torch.randn(1000)
    a = rounding.to_bf16(x, stochastic=True, key=5, index0=3)
    meta = rounding.sr_bits(5, 3, 1000, device="meta")
    assert meta.device.type == "meta" and meta.shape == (1000,)
    assert torch.equal(rounding.sr_bits(5, 3, 1000, device="cpu"), rounding.sr_bits(5, 3, 1000))
    assert a.dtype == BF16
