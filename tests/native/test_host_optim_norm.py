"""grad_sq_norm: the squared L2 norm for clipping, and non-finite gradients reported, never hidden."""
import math

import pytest
import torch

from _host_optim_ref import IMPLS, LENGTHS
from zerokit.optim import host

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _reference(g: torch.Tensor) -> float:
    x = g.to(torch.float64)
    return float(torch.dot(x, x))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("n", LENGTHS)
def test_sq_norm_matches_double_reference(impl, dtype, n):
    g = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    total, finite = host.grad_sq_norm(g, impl=impl)
    assert finite
    assert total == pytest.approx(_reference(g), rel=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
def test_sq_norm_does_not_overflow_on_large_finite_values(impl):
    # 1e30**2 overflows fp32; accumulated in double it stays finite and exact.
    g = torch.full((1001,), 1e30, dtype=torch.bfloat16)
    total, finite = host.grad_sq_norm(g, impl=impl)
    assert finite and math.isfinite(total)
    assert total == pytest.approx(1001 * g[0].double().item() ** 2, rel=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", [0, 500, 1_000_002], ids=["first", "middle", "tail"])
def test_non_finite_is_reported(impl, dtype, bad, where):
    g = torch.randn(1_000_003, generator=torch.Generator().manual_seed(1)).to(dtype)
    g[where] = bad
    total, finite = host.grad_sq_norm(g, impl=impl)
    assert not finite
    assert not math.isfinite(total)


def test_fp16_overflow_from_a_scaled_backward_is_reported():
    # A value past fp16's range already became inf during the cast: the flag must catch it.
    g = (torch.randn(4097) * 1e5).to(torch.float16)
    assert g.isinf().any()
    assert host.grad_sq_norm(g)[1] is False


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_gradient(impl):
    assert host.grad_sq_norm(torch.empty(0), impl=impl) == (0.0, True)
