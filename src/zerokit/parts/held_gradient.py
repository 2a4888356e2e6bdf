"""Gradients in host memory: held, never in a file (offload_optimizer.step_in_backward, or an
nvme part's with offload_optimizer.nvme_gradients 'host'), and a host part's gradient records.

[Note: held gradients]
Stepped in backward (parts/speculation.py), a host or nvme part's gradient (the master's dtype)
lives in a host buffer of the part's own, allocated when its first piece lands and kept step
after step (a fresh buffer per step would pay its page faults again each time: seconds per step
at 1B); an nvme part's gradient never goes to a file. It is held until the step decides: a
rollback steps again from the same values (a redo), so the buffer is every offloaded element's
4 bytes, counted in the ledger and the host budget (engine/assemble.py). With nvme_gradients
'host' (stepped in step()) an nvme part holds its gradient the same way, so the stream reads
master and state only and an accumulation adds in memory (engine/byte_plan.py counts the nvme
parts' elements; a host part keeps its gradient record).

The first piece on a range is copied, not added, and nothing is zeroed but the elements no piece
reached (`settle`); later pieces on the same elements (accumulation over micro-steps) are added.
The sum of squares is taken per piece, as FileGradient (parts/nvme.py) does for the gradient
files (recounted whole after an accumulation). A host part's gradient records (stepped in
step(), parts/host.py) land the same way; they were zeroed after each step, every piece added
into them and read once more for the norm: three passes per step where one copy does (and an
fp32 record adding bf16 pieces took torch's unvectorized mixed-dtype add, see optim/host.py
`accumulate`). Copying where an add would meet zeros gives the same bits: x + 0 is x, and a
-0.0 copied where the add gave +0.0 steps alike (a kernel reads g through g, g * g and the sign
of a sum with it, all the same for either zero).
"""
from __future__ import annotations

import torch

from zerokit.io.buffers import aligned_empty
from zerokit.optim import host as host_kernels
from zerokit.parts.ranges import uncovered


def refuse_sum(owner: str, dtype: torch.dtype):
    """A second backward before step() would add into a gradient kept in 16 bits for one
    backward per step ([Note: 16-bit offloaded gradients] in engine/precision.py): the sum would
    round where the master's dtype would not. Raised before anything is added."""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype).replace("torch.", ""))
    raise RuntimeError(
        f"a second backward before step() adds into {owner}'s offloaded gradient, kept in {name} "
        f"because gradient_accumulation_steps is 1 (offload_optimizer.gradient_dtype 'auto': exact "
        f"for one backward per step, not for a sum). Set gradient_accumulation_steps to the number "
        f"of backward calls per step, or offload_optimizer.gradient_dtype to 'master'")


def host_buffer(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A host tensor at a 4096-aligned address: a file range at offset 0 moves by O_DIRECT."""
    return aligned_empty(numel * torch.empty(0, dtype=dtype).element_size()).view(dtype)


class HeldGradient:
    """A part's gradient in host memory (see the note), in the placement's gradient dtype: the
    master's (fp32, or bf16 with bf16.bf16_master_weights_and_grads: rounded and accumulated as
    the host part's own gradient buffer is, so the speculative step reads the same values), or
    the 16-bit gradient's own at one micro-step per step, where `sums_refused_for` names the
    part whose second backward is refused (`refuse_sum`)."""

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32,
                 sums_refused_for: str | None = None, buffer: torch.Tensor | None = None):
        """buffer: where the gradient lands, a buffer the layout allocated and counted (a host
        part's gradient record, host_grad0/1); else allocated at the first piece."""
        self.numel = numel
        self.dtype = dtype
        self.sums_refused_for = sums_refused_for
        self.counted = None  # the ledger's count of this buffer, called with its bytes when allocated
        self._buf: torch.Tensor | None = buffer  # allocated at the first piece, then kept
        self._landed: list[tuple[int, int]] = []  # [lo, hi) written since the last release
        self._settled = True
        self._sq = 0.0

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self.numel * self._buf.element_size()

    def _landing(self) -> torch.Tensor:
        if self._buf is None:
            self._buf = host_buffer(self.numel, self.dtype)
            if self.counted is not None:
                self.counted(self.nbytes)
        return self._buf

    def add(self, piece: torch.Tensor, offset: int) -> None:
        lo, hi = offset, offset + piece.numel()
        dest = self._landing()[lo:hi]
        if any(a < hi and lo < b for a, b in self._landed):  # accumulation: add
            if self.sums_refused_for is not None:
                refuse_sum(self.sums_refused_for, self.dtype)
            host_kernels.accumulate(dest, piece.to("cpu"))
            self._sq = float("nan")  # recomputed in settle
        else:
            dest.copy_(piece)
            self._sq += host_kernels.grad_sq_norm(dest)[0]
        self._landed.append((lo, hi))
        self._settled = False

    def settle(self) -> None:
        """Elements no piece reached are zero; the norm is exact."""
        if self._buf is None or (self._settled and self._landed):
            return
        if not self._landed:  # nothing landed since the last release: all zero
            self._sq = 0.0
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

    def clear(self) -> None:
        """The step is done (engine zero_grad): the next piece starts a new gradient."""
        self._landed, self._settled = [], True
        self._sq = 0.0
