"""Stage 3 gathers a unit's weights into memory whose pages were handed back at its release
([Note: gathered weights keep their address] in units/unit.py), so every gather faults them in
again. On the CPU that memory asks for 2 MiB pages before it is first touched (aligned_empty in
io/buffers.py),
so a gather faults in hundreds of times fewer pages. Two ranks: one rank's shard is its weights,
never gathered. Measured with getrusage's minor faults, not the code's own counters."""
from __future__ import annotations

import resource

import pytest
import torch
from torch import nn

from harness import run_world
from zerokit.io import huge_pages
from zerokit.states import WeightState

WIDTH = 3200  # one 40 MiB fp32 unit: 10,000 faults a gather with 4 KiB pages


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class OneBlock(nn.Module):
    """A block unit (the root's leftovers would stay gathered through the step)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH, bias=False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)


def _gather_faults(rank: int, world: int) -> dict:
    import zerokit

    torch.manual_seed(0)
    model = OneBlock()
    engine, *_ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    x = torch.randn(2, WIDTH)
    engine.backward(engine(x).square().mean())
    engine.step()  # the first step faults in whatever else it needs
    unit = engine.units[0]
    sharded = unit.state is WeightState.SHARDED  # released: the forward below gathers it
    before = _faults()
    with torch.no_grad():
        engine(x)  # gathers the unit again
    out = {"faulted": _faults() - before, "sharded": sharded}
    engine.destroy()
    return out


@pytest.mark.skipif(huge_pages.thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are off on this machine: 4 KiB pages are all it has")
def test_a_gathered_unit_faults_in_huge_pages_not_4k_ones() -> None:
    for r in run_world(_gather_faults, 2, timeout=120):
        assert r["sharded"], r
        assert r["faulted"] < WIDTH * WIDTH * 4 // 4096 // 8, r["faulted"]
