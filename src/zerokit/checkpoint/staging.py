"""The host staging buffer of asynchronous saves: device tensors of the snapshot are copied
here, then written (host tensors are written in place: [Note: async save without a host copy]).

One buffer per engine, kept on its save lease (units/lease.py `ReadLease.staging`) and reused:
the next save waits for the previous one, so one suffices, and reuse spares every save but the
first the page faults of fresh memory. The first save's copy faults the whole buffer in (0.5 GB
per rank: measured 0.2 s alone, 0.8-1.4 s with two ranks faulting at once on the 2-core VM,
against 0.1 s for a later save). Advising the buffer to transparent huge pages was measured
worse, not better (2.3 s: the kernel compacts memory to find 2 MiB pages), so the buffer has
ordinary pages.
"""
from __future__ import annotations

import torch

from zerokit.checkpoint.storage import Parts, entry_of, nbytes_of
from zerokit.units.lease import ReadLease


def stage(lease: ReadLease, device: torch.device, tensors: list[tuple[str, torch.Tensor | Parts]]
          ) -> list[tuple[str, torch.Tensor]]:
    """Copy into the lease's reusable host staging buffer (64-byte aligned slices)."""
    cuda = device.type == "cuda"
    offsets, total = [], 0
    for _, t in tensors:
        offsets.append(total)
        total += -(-nbytes_of(t) // 64) * 64
    buf = lease.staging
    if buf is None or buf.numel() < total:
        buf = lease.staging = _allocate(total, cuda)
    staged = []
    for (name, t), off in zip(tensors, offsets):
        dtype, shape = entry_of(t)
        dst = buf[off:off + nbytes_of(t)].view(dtype)
        pos = 0
        for p in (t if isinstance(t, list) else [t]):
            dst[pos:pos + p.numel()].copy_(p.detach().reshape(-1), non_blocking=True)
            pos += p.numel()
        staged.append((name, dst.view(shape)))
    if cuda:
        torch.cuda.current_stream().synchronize()
    return staged


def _allocate(nbytes: int, cuda: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda and torch.cuda.is_available())
