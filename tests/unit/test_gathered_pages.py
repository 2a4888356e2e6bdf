"""Stage 3 gathers a unit's weights into fresh memory at every use (autograd keeps views of that
storage, so no cache can hand the old pages back). On the CPU the buffer asks for 2 MiB pages
before it is touched (io/huge_pages.py), so a gather faults in hundreds of times fewer pages.
Measured with getrusage's minor faults, not the code's own counters."""
from __future__ import annotations

import resource

import pytest
import torch
from torch import nn

from zerokit.io import huge_pages


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(huge_pages.thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are off on this machine: 4 KiB pages are all it has")
def test_a_gathered_unit_faults_in_huge_pages_not_4k_ones() -> None:
    import zerokit

    torch.manual_seed(0)
    # one 40 MiB fp32 unit, above glibc's largest mmap threshold (32 MiB), so every gather is a
    # fresh mapping: 10,000 faults with 4 KiB pages
    width = 3200
    model = nn.Sequential(nn.Linear(width, width, bias=False))
    engine, *_ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    x = torch.randn(2, width)
    engine.backward(engine(x).square().mean())
    engine.step()  # the first step faults in whatever else it needs
    before = _faults()
    with torch.no_grad():
        engine(x)  # gathers the unit again
    faulted = _faults() - before
    assert faulted < width * width * 4 // 4096 // 8, faulted
