"""A unit's gradient reduction: backward's side of units/unit.py, from the hook that finds a
unit's gradients complete to the reduced average in each optimizer part.

[Note: one reduction, one meaning]
Below stage 2 a rank's gradients are summed locally over the micro-steps (in `grad_acc` where it
exists, else in `grad_flat`) and reduced once, at the boundary: the reduced average *is* the
step's gradient, so it is written into `master_grad`, never added to it. From stage 2 on, every
micro-step is reduced and each average is added into `master_grad`. Written this way, the
aliases of [Note: unit state per rank] in units/unit.py (stage 0: `master_grad` is `grad_flat` in
fp32, is `grad_acc` with 16-bit accumulation) are harmless whatever the reduce dtype: the collective runs in place on the local sum, or on a copy
of it in the reduce dtype that is then written back over it. Adding instead would leave
`master_grad` = local sum + global average wherever the local sum lives in `master_grad` and
crosses in another dtype (issue #14).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from zerokit.comm.collectives import Handle
from zerokit.io.buffers import SECTOR_ELEMENTS
from zerokit.optim.host import accumulate
from zerokit.policy import PlacementPolicy
from zerokit.policy.layout import ALIGN
from zerokit.tiers import TierName


def bucket_numel(reduce_bucket_size: int, world: int, placement: PlacementPolicy) -> int:
    """The elements per reduction bucket the units are given for zero_optimization.reduce_bucket_size.

    [Note: buckets on sectors]
    Where the optimizer is on NVMe with gradients in files, each reduce-scatter bucket's piece is
    written into its part's gradient file at the piece's offset as soon as it is reduced
    (parts/nvme.py FileGradient; one file per part, from offset 0). The I/O engine sends a block
    straight to disk only where file offset and buffer address agree modulo 4096 (io/aio.py
    [Note: file residue]); a piece anywhere else is staged through bounce buffers, a write's edge
    sectors read back first: the cost that sub-groups had before [Note: sector-aligned
    sub-groups]. A bucket of k x world x SECTOR_ELEMENTS gives each rank pieces of k x
    SECTOR_ELEMENTS columns, so with the optimizer on NVMe the size asked is rounded up to that:
    every piece then starts on a sector of its part's file in every dtype, whatever was asked
    (DeepSpeed's default, 500,000,000, and the usual 5e7 and 2e8 are not multiples: 5e7 fp32
    elements end 512 bytes past a sector). The one unit that offload_optimizer.max_in_cpu
    splits has its NVMe part start inside it: the split is on a sector there too
    (PlacementPolicy.ram_split). Rank-independent (the cuts must agree); the reduction is
    elementwise, so where they fall changes no bit."""
    if not placement.nvme or placement.holds_nvme_gradients:
        return reduce_bucket_size
    step = world * SECTOR_ELEMENTS
    return -(-reduce_bucket_size // step) * step


class GradientReduction:
    """Unit's reduction methods (a base of Unit, whose buffers and policies they use:
    `grad_flat`, `grad_acc`, `master_grad`, `parts`, `layout`, `comm`; `_ready` and `_launched`
    are this side's state, created by Unit.__init__)."""

    def on_grad_ready(self, param: nn.Parameter, index: int, reduce_now: bool) -> bool:
        """Called from the post-accumulate-grad hook; True once all arrived and it is time to
        reduce (the engine then launches the reduction)."""
        if self.grad_flat is not None:
            view = self._grad_views[index]
            if param.grad is not view:
                # Someone reset .grad (model.zero_grad()) and autograd handed us a new tensor with
                # this backward's gradient only: the view still holds the earlier micro-steps'.
                if param.grad is not None:
                    view.add_(param.grad)
                param.grad = view
        self._ready.add(index)
        self.used = True
        return reduce_now and not self.reduce_at_end and len(self._ready) == len(self.slots)

    def launch_reduce(self) -> Handle:
        """Reduce this unit's gradients into `master_grad` (asynchronously)."""
        self._launched = True
        if self.grad_flat is not None:
            # The full gradient is scratch from here on (zeroed after the step), so reduce in place.
            local, name = self.grad_flat, "grads"
            if self.grad_acc is not None:
                local, name = accumulate(self.grad_acc, self.grad_flat), "grad_acc"
            if local.dtype == self.reduce_dtype:
                # The collective runs in the buffer; where that buffer is the master gradient
                # (stage 0 aliases), the result is already in place.
                in_master = (self.layout.aliases("master_grad", name)
                             or self.layout.aliases(name, "master_grad"))
                return self._reduce_into_master(local, lambda: None, in_master)
            full = local.to(self.reduce_dtype)
            release = self.ledger.transient("buffers", full)
        else:
            # Not zeros: the gradients overwrite nearly all of it, so zero only what they do not
            # (a parameter without a gradient, the padding); one pass over the bucket, not two.
            full, release = self._reduction_bucket()
            for s in self.slots:
                g, part = s.param.grad, full[s.offset:s.offset + s.numel]
                if g is None:
                    part.zero_()
                    continue
                part.copy_(g.reshape(-1))
                s.param.grad = None  # stage 2: the full-size gradient lives only in the bucket
            full[self.numel:].zero_()
        return self._reduce_into_master(full, release, False)

    def _reduction_bucket(self) -> tuple[torch.Tensor, Callable[[], None]]:
        """The unit's full gradient in the reduce dtype, and the function that frees it: on a
        CPU device a scratch buffer, reused step after step (see [Note: scratch buffers])."""
        if self.device.type == "cpu":
            return self.ledger.scratch.take("buffers", self.padded_numel, self.reduce_dtype)
        full = torch.empty(self.padded_numel, dtype=self.reduce_dtype, device=self.device)
        return full, self.ledger.transient("buffers", full)

    def _reduce_into_master(self, full: torch.Tensor, release, in_master: bool) -> Handle:
        """Average `full` over ranks into master_grad, in collectives of at most bucket_numel.
        release: frees `full` once reduced (a temporary); in_master: `full` is master_grad."""
        comm, world = self.comm, self.comm.world_size
        pre, post = self.grad_scales
        if pre != 1.0 and world > 1:  # at world 1, pre and post cancel: DeepSpeed's rounding aside
            full.mul_(pre)
        handles: list[Handle] = []
        if not self.policy.shard_optimizer:  # all-reduce; master covers the whole buffer
            step = max(ALIGN, self.bucket_numel)
            for lo in range(0, self.padded_numel, step):
                part = full[lo:lo + step]
                handles.append(comm.all_reduce_(part, self._where(lo, step), average=True, async_op=True,
                                                unit=self.index, post_scale=post))
            deliver = (lambda: None) if in_master else (lambda: self._deliver(full, 0, self.padded_numel))
            return Handle.joined(handles, lambda: (deliver(), release()))
        # At world 1 the reduce-scatter would copy `full` into `out`: `full` is the result.
        out = full if world == 1 else torch.empty(self.shard_numel, dtype=self.reduce_dtype,
                                                  device=self.device)
        chunk = max(ALIGN, -(-self.bucket_numel // (world * ALIGN)) * ALIGN)
        rows = full.view(world, self.shard_numel)
        for lo in range(0, self.shard_numel, chunk):
            hi = min(lo + chunk, self.shard_numel)
            # One bucket = the same column range of every rank's shard, so a reduce-scatter of it
            # hands each rank its own piece.
            handle = comm.reduce_scatter(out[lo:hi], rows[:, lo:hi], self._where(lo, chunk),
                                         average=True, async_op=True, unit=self.index,
                                         post_scale=post)
            if self._streams_buckets:  # a part off the device: each bucket leaves once reduced
                start = self.opt_range[0]
                handle = Handle.joined([handle], lambda lo=lo, hi=hi:
                               self._deliver(out[lo:hi], start + lo, start + hi))
            handles.append(handle)
        if self._streams_buckets:
            return Handle.joined(handles, release)
        start = self.opt_range[0]
        return Handle.joined(handles, lambda: (self._deliver(out, start, start + self.shard_numel), release()))

    @property
    def _streams_buckets(self) -> bool:
        return any(p.tier is not TierName.DEVICE for p in self.parts)

    def _deliver(self, reduced: torch.Tensor, lo: int, hi: int) -> None:
        """The reduced gradient of elements [lo, hi) of the optimizer range (flat index space)
        -> each part it overlaps, wherever that part's master lives. See [Note: one reduction,
        one meaning]: a device part writes where reduced once per step, adds where reduced every
        micro-step; a host or nvme part copies the first piece on its elements since the step and adds
        later ones (parts/held_gradient.py [Note: held gradients])."""
        for part in self.parts:
            a, b = max(lo, part.lo), min(hi, part.hi)
            if a < b:
                part.take_grad(reduced[a - lo:b - lo], a - part.lo)

    def _where(self, lo: int, step: int) -> str:
        return f"unit '{self.name}'" if step >= self.padded_numel else \
            f"unit '{self.name}' bucket {lo // step}"

    def end_backward(self) -> None:
        if not self._launched and self.grad_acc is not None:  # a micro-step before the boundary
            accumulate(self.grad_acc, self.grad_flat)
            self.grad_flat.zero_()
        self._ready.clear()
        self._launched = False

    @property
    def launched(self) -> bool:
        return self._launched
