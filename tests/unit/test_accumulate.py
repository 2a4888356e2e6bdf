"""optim/host.py `accumulate`: dest += src through a widened chunk, the same bits as add_."""
from __future__ import annotations

import pytest
import torch

from zerokit.optim import host as host_kernels
from zerokit.optim.host import ACCUMULATE_CHUNK, accumulate


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.parametrize("dest_dtype,src_dtype", [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
    (torch.bfloat16, torch.float32), (torch.float16, torch.float32)])
def test_the_same_bits_as_add_(dest_dtype, src_dtype):
    """Over several chunks and a partial last one, across magnitudes where the sum rounds, with
    NaN, infinities, signed zeros and subnormals."""
    g = torch.Generator().manual_seed(0)
    n = 2 * ACCUMULATE_CHUNK + 123
    dest = (torch.randn(n, generator=g) * torch.logspace(-40, 30, n)).to(dest_dtype)
    src = (torch.randn(n, generator=g) * torch.logspace(30, -40, n)).to(src_dtype)
    dest[:6] = torch.tensor([float("nan"), float("inf"), -0.0, 0.0, 1e-45, 1.0]).to(dest_dtype)
    src[:6] = torch.tensor([1.0, float("-inf"), -0.0, -0.0, 1e-40, float("nan")]).to(src_dtype)
    want = dest.clone().add_(src)
    got = dest.clone()
    assert accumulate(got, src) is got
    assert torch.equal(_bits(got), _bits(want))
    assert not torch.equal(_bits(want), _bits(dest))  # the sums changed something


def test_other_cases_are_add_itself():
    """One dtype, a small or non-contiguous dest: add_ as it was."""
    a, b = torch.ones(8), torch.full((8,), 2.0, dtype=torch.bfloat16)
    assert torch.equal(accumulate(a, b), torch.full((8,), 3.0))
    big = torch.zeros(ACCUMULATE_CHUNK, 2)
    col = big[:, 0]  # a strided view: written through, not a copy
    accumulate(col, torch.ones(ACCUMULATE_CHUNK, dtype=torch.bfloat16))
    assert big[:, 0].sum() == ACCUMULATE_CHUNK and big[:, 1].sum() == 0
    assert "accumulate" in host_kernels.__all__
