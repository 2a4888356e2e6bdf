"""Gradients held in host memory only while in use (offload_optimizer.step_in_backward).

[Note: held gradients]
Stepped in backward (parts/executors.py), a host or nvme part needs its fp32 gradient only from
its reduction until its executor has stepped it: no buffer of the part's size is kept between
steps, and an nvme part's gradient never goes to a file. A `HeldGradient` takes a buffer from the
engine's `GradientPool` when the first piece lands and gives it back once stepped. The pool keeps
`count` buffers of the largest part's size and reuses them step after step: a fresh buffer per
part per step would pay its page faults again each time (seen at 1B: seconds of kernel time per
step). A gradient that finds no buffer free waits while an offered one is being stepped (that
frees one); when none is (units whose gradients wait for step(), see Engine._launch_reduce), it
gets a buffer of its own, so nothing can wait forever.

The first piece on a range is copied, not added, and nothing is zeroed but the elements no piece
reached (`settle`); later pieces on the same elements (accumulation over micro-steps) are added.
The sum of squares is taken per piece, as FileGradient (parts/nvme.py) does for the gradient
files (recounted whole after an accumulation).

Under the speculative step (parts/speculation.py) a gradient is `persistent`: its buffer is the
part's own, kept between steps (no pool), and after the speculative update it stays until the
step decides (`keep`): a redo steps again from it.
"""
from __future__ import annotations

import threading

import torch

from zerokit.io.buffers import aligned_empty
from zerokit.optim import host as host_kernels
from zerokit.parts.ranges import uncovered


def host_buffer(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A host tensor at a 4096-aligned address: a file range at offset 0 moves by O_DIRECT."""
    return aligned_empty(numel * torch.empty(0, dtype=dtype).element_size()).view(dtype)


class GradientPool:
    """`count` host buffers of `numel` fp32 elements, lent to held gradients (see the note)."""

    def __init__(self, numel: int, count: int):
        self.numel, self.count = numel, count
        self._free: list[torch.Tensor] = []
        self._made = 0
        self._own = 0  # bytes of buffers lent outside the pool (none free, none to wait for)
        self._holders: set[HeldGradient] = set()
        self._cv = threading.Condition()

    @property
    def nbytes(self) -> int:
        return self._made * self.numel * 4 + self._own

    def take(self, holder: "HeldGradient") -> torch.Tensor:
        with self._cv:
            while True:
                if self._free:
                    buf = self._free.pop()
                    break
                if self._made < self.count and holder.numel <= self.numel:
                    self._made += 1
                    buf = host_buffer(self.numel)
                    break
                if not any(h.offered for h in self._holders):
                    self._own += holder.numel * 4
                    return host_buffer(holder.numel)
                # the worker gives one back when it has stepped an offered part; the timeout
                # re-checks the holders should that worker have stopped on an error
                self._cv.wait(timeout=0.5)
            self._holders.add(holder)
            return buf

    def give(self, holder: "HeldGradient", buf: torch.Tensor) -> None:
        with self._cv:
            if holder in self._holders:
                self._holders.discard(holder)
                self._free.append(buf)
                self._cv.notify_all()
            else:
                self._own -= buf.numel() * 4


class HeldGradient:
    """A part's fp32 gradient, held from its first piece until released (see the note)."""

    def __init__(self, numel: int):
        self.numel = numel
        self.pool: GradientPool | None = None  # set by the executor stepping the part
        self.offered = False  # handed to a running worker, which will release it
        self.persistent = False  # the speculative step: the buffer is kept (see the note)
        self._buf: torch.Tensor | None = None  # what the pool lent (may be longer)
        self._landed: list[tuple[int, int]] = []  # [lo, hi) written since the last release
        self._settled = True
        self._sq = 0.0

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self.numel * 4

    def _landing(self) -> torch.Tensor:
        if self._buf is None:
            self._buf = self.pool.take(self) if self.pool is not None else host_buffer(self.numel)
        return self._buf[:self.numel]

    def add(self, piece: torch.Tensor, offset: int) -> None:
        lo, hi = offset, offset + piece.numel()
        dest = self._landing()[lo:hi]
        if any(a < hi and lo < b for a, b in self._landed):  # not expected (see the note)
            dest.add_(piece.to("cpu"))
            self._sq = float("nan")  # recomputed in settle
        else:
            dest.copy_(piece)
            self._sq += host_kernels.grad_sq_norm(dest)[0]
        self._landed.append((lo, hi))
        self._settled = False

    def settle(self) -> None:
        """Elements no piece reached are zero; the norm is exact."""
        if self._settled or self._buf is None:
            return
        buf = self._landing()
        for a, b in uncovered(0, self.numel, self._landed):
            buf[a:b].zero_()
        if self._sq != self._sq:  # NaN: an overlap, or a non-finite piece; recount
            self._sq = host_kernels.grad_sq_norm(buf)[0]
        self._landed = [(0, self.numel)]
        self._settled = True

    def values(self, lo: int = 0, n: int | None = None) -> torch.Tensor:
        """Elements [lo, lo + n) for the kernel, settled."""
        self._landing()
        self.settle()
        return self._buf[lo:self.numel if n is None else lo + n]

    def sq_norm(self) -> float:
        self.settle()
        return self._sq

    def zero_unwritten(self) -> None:
        self.settle()

    def keep(self) -> None:
        """Stepped speculatively: the values stay until the step decides (see the note)."""
        self.offered = False

    def release(self) -> None:
        """Stepped: the buffer goes back (the norm stays until `clear`); a persistent one stays
        the part's, its values spent."""
        self.offered = False
        self._landed, self._settled = [], True
        if self.persistent:
            return
        buf, self._buf = self._buf, None
        if buf is not None and self.pool is not None:
            self.pool.give(self, buf)

    def clear(self) -> None:
        self.release()
        self._sq = 0.0
