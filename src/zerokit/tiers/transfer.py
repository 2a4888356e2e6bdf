"""Copies between tiers that overlap compute: one side stream per CUDA device.

On CUDA, host <-> device copies of offloaded state (gradient buckets out, weight shards in) run on
a side stream with non_blocking=True from page-locked buffers, so they overlap the kernels on the
compute stream; whoever reads the result first orders its stream after the side stream. On a
CPU-only machine there are no streams and a copy is an ordinary (synchronous) copy between two
buffers, so the same code runs with the ordering calls as no-ops.
"""
from __future__ import annotations

import torch

_SIDE: dict[torch.device, "torch.cuda.Stream"] = {}


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


def uses_streams(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"
