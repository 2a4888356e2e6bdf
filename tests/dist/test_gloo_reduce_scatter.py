"""gloo's reduce-scatter (comm/collectives.py `_exchange_reduce`) against a sum computed here.

At world 2 our row and the peer's are added once (addition commutes: both ranks of a pair agree);
wider, the rows are summed in rank order. Either way every rank must get, bit for bit, the sum a
single process computes in rank order. The rows are random bf16 / fp32 values of mixed
magnitude, so an addition in another order or a row dropped changes bits. Cases: `out` a
separate buffer, `out` one of the input's own rows (reduced in place), two exchanges in flight
at once (their messages pair up by issue order), and a column-range bucket with a post scale.
"""
from __future__ import annotations

import pytest
import torch

from harness import run_world

N = 3000  # a few gloo pieces' worth at bf16 and a short tail


def _rows(world: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every rank's input (row r of rank k's buffer is what rank k sends rank r), the same on all."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 3, N, dtype=torch.float64)
    return (torch.randn(world, world, N, generator=g, dtype=torch.float64) * scale).to(dtype)


def _expected(inputs: torch.Tensor, rank: int, scale: float) -> torch.Tensor:
    """Rank `rank`'s result: its row of every rank's input summed over the ranks as one process
    sums a rank-ordered stack (at world 2 that is one addition in the dtype)."""
    acc = torch.sum(inputs[:, rank], dim=0)
    return acc * scale if scale != 1.0 else acc


def _reduce_scatters(rank: int, world: int, dtype_name: str) -> dict:
    from zerokit.comm.collectives import Comm
    dtype = getattr(torch, dtype_name)
    comm = Comm.from_environment(timeout_s=60)
    checked = {}
    # out separate, averaged
    inputs = _rows(world, dtype, 1)
    full = inputs[rank].clone()
    out = torch.empty(N, dtype=dtype)
    comm.reduce_scatter(out, full, "test separate", average=True, unit=0)
    checked["separate"] = torch.equal(out, _expected(inputs, rank, 1.0 / world))
    checked["input unchanged"] = torch.equal(full, inputs[rank])
    # out is this rank's own row of the input (reduced in place)
    inputs = _rows(world, dtype, 2)
    full = inputs[rank].clone()
    comm.reduce_scatter(full[rank], full, "test in place", average=False, unit=1)
    checked["in place"] = torch.equal(full[rank], _expected(inputs, rank, 1.0))
    # two in flight: the second posted before the first is waited
    a_in, b_in = _rows(world, dtype, 3), _rows(world, dtype, 4)
    a_out, b_out = torch.empty(N, dtype=dtype), torch.empty(N, dtype=dtype)
    a = comm.reduce_scatter(a_out, a_in[rank].clone(), "test a", average=False, async_op=True, unit=2)
    b = comm.reduce_scatter(b_out, b_in[rank].clone(), "test b", average=False, async_op=True, unit=3)
    b.wait()
    a.wait()
    checked["in flight"] = (torch.equal(a_out, _expected(a_in, rank, 1.0))
                            and torch.equal(b_out, _expected(b_in, rank, 1.0)))
    # a (world, n) view of column ranges, as units/reduction.py buckets pass it, with a post scale
    inputs = _rows(world, dtype, 5)
    flat = inputs[rank].clone().view(-1)
    rows = flat.view(world, N)[:, 1000:2000]
    out = torch.empty(1000, dtype=dtype)
    comm.reduce_scatter(out, rows, "test bucket", post_scale=0.25, unit=4)
    checked["bucket"] = torch.equal(out, _expected(inputs[:, :, 1000:2000], rank, 0.25))
    return {"checked": checked}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reduce_scatter_equals_the_sum_in_rank_order(world: int, dtype: str) -> None:
    results = run_world(_reduce_scatters, world, dtype)
    for rank, res in enumerate(results):
        failed = [k for k, ok in res["checked"].items() if not ok]
        assert not failed, f"rank {rank}: {failed} differ from the sum in rank order"
