"""The nvme part of a unit's optimizer range: master, optimizer state and gradient in files.

See [Note: optimizer parts] in parts/__init__.py. An `NvmePart` keeps its master, optimizer
state and gradient as `FileRange`s (fp32, or bf16 with bf16.bf16_master_weights_and_grads /
bf16_optimizer_states: 2 bytes per element per file, the host part's dtypes) on the nvme tier (tiers/nvme.py) where a host part keeps host
tensors (as DeepSpeed swaps its fp32 gradient partitions); only its new compute-dtype weights
(`out16`, whatever the dtype; with offload_param and no delay, the host shard itself) stay in
host memory, written back through the same `WeightsOut` a host part holds (parts/kernel_part.py).
The gradient arrives through `FileGradient` (below), or is held in memory (step_in_backward, or
offload_optimizer.nvme_gradients 'host': placement.holds_nvme_gradients). The streaming executor (parts/nvme_executor.py) steps it a sub-group at
a time; the few operations that need the whole master (an edit under GatheredParameters,
`full_master`) read it whole, one part at a time.
"""
from __future__ import annotations

from typing import Callable

import torch

from zerokit.io.aio import wait_all
from zerokit.optim import host as host_kernels
from zerokit.parts.held_gradient import HeldGradient, host_buffer, refuse_sum
from zerokit.parts.kernel_part import STATE_NAMES, PartSpan, WeightsOut
from zerokit.parts.ranges import uncovered
from zerokit.policy.layout import OptimizerPart
from zerokit.tier_names import TierName
from zerokit.tiers.nvme import FileRange, NvmeTier
from zerokit.tiers.nvme_shard import FileHome


def read_range(nvme: NvmeTier, rng: FileRange) -> torch.Tensor:
    out = host_buffer(rng.numel, rng.dtype)
    nvme.read(rng, out).wait()
    return out


def fill_range(nvme: NvmeTier, rng: FileRange, values: torch.Tensor | float) -> None:
    """The file range <- values (a tensor of its length, or one number)."""
    buf = host_buffer(rng.numel, rng.dtype)
    if isinstance(values, torch.Tensor):
        buf.copy_(values)
    else:
        buf.fill_(values)
    nvme.write(rng, buf).wait()


# Gradient pieces are copied out of the reduction's buckets into scratch buffers of at most
# this size, written in the tier's write window (tiers/nvme.py WRITES_IN_FLIGHT_BYTES).
GRAD_CHUNK_BYTES = 32 << 20


class FileGradient:
    """A part's gradient in its file range (placement.gradient_dtype: the master's, fp32 or bf16,
    or the 16-bit gradient's own where that is exact), written as reduced pieces arrive.

    [Note: gradients on NVMe]
    A piece is copied out of the reduction's bucket into host buffers of at most
    GRAD_CHUNK_BYTES and written asynchronously in the tier's write window (its WriteWindow,
    which initialize sizes to hold the largest part's gradient: a unit's writes then run while
    backward computes the next units). The file is not zeroed after a step: `clear()` forgets
    what was written, a piece landing on elements already written since (gradient accumulation)
    is read, a chunk at a time (through the tier's ReadAhead: read before the piece arrives, see
    [Note: gradient read-ahead] in tiers/read_ahead.py), the piece added to it (in the file's
    dtype, as the host part adds into its gradient buffer: bf16 sums round alike) and written
    back, and elements no piece reached are written as zeros before the step reads them
    (`zero_unwritten`). The sum of squares is taken from each chunk as it is written (float64),
    so the norm costs no second read; only after an accumulation that re-cut earlier pieces is
    the file read to recompute it.
    """

    def __init__(self, nvme: NvmeTier, rng: FileRange, sums_refused_for: str | None = None):
        self.nvme, self.range = nvme, rng
        # a 16-bit file under a wider master, exact for one backward per step only: the part
        # whose second backward is refused (parts/held_gradient.py refuse_sum)
        self.sums_refused_for = sums_refused_for
        # this file's writes in flight, [lo, hi) each (the tier's window bounds all files' together)
        self._writes: list[tuple[int, int, object]] = []
        self._written: dict[tuple[int, int], float] = {}  # [lo, hi) since clear -> sum of squares
        self._exact = True  # the sums above cover exactly what the file holds

    def add(self, piece: torch.Tensor, offset: int) -> None:
        lo, hi = offset, offset + piece.numel()
        # Through scratch buffers of at most GRAD_CHUNK_BYTES (see [Note: scratch buffers]): the
        # cache then holds a few buffers of that size, not one per size of piece.
        chunk = max(1, GRAD_CHUNK_BYTES // torch.empty(0, dtype=self.range.dtype).element_size())
        # accumulation: the earlier value of these elements, plus this piece
        overlapped = [r for r in self._written if r[0] < hi and lo < r[1]]
        if overlapped and self.sums_refused_for is not None:
            refuse_sum(self.sums_refused_for, self.range.dtype)
        gaps = uncovered(lo, hi, overlapped) if overlapped else []  # never written since clear: zero
        sq = 0.0
        for a in range(lo, hi, chunk):
            b = min(hi, a + chunk)
            if overlapped:
                self._settle(a, b)  # an earlier micro-step's write of these elements has ended
                buf, give_back = self.nvme.read_ahead.read(self.range.narrow(a, b - a), self._readable)
                for gap_lo, gap_hi in gaps:
                    if gap_lo < b and a < gap_hi:
                        buf[max(gap_lo, a) - a:min(gap_hi, b) - a] = 0.0
                # earlier + piece, rounded once to the file's dtype
                host_kernels.accumulate(buf, piece[a - lo:b - lo].to("cpu"))
            else:
                buf, give_back = self.nvme.ledger.scratch.take("buffers", b - a, self.range.dtype,
                                                               TierName.HOST)
                buf.copy_(piece[a - lo:b - lo])
            sq += host_kernels.grad_sq_norm(buf)[0]  # the host part's kernel
            self._write(a, buf, give_back)
        # (after the chunks: until then the read-ahead sees the earlier sums as written)
        for a, b in overlapped:  # what lies outside this piece stays written
            del self._written[(a, b)]
            for rest in ((a, lo), (hi, b)):
                if rest[0] < rest[1]:
                    self._written[rest] = 0.0  # its share of the sum is unknown now
                    self._exact = False
        self._written[(lo, hi)] = sq

    def _readable(self, rng: FileRange) -> bool:
        """Whether the tier may read `rng` (a range of this file) ahead: it holds an earlier
        micro-step's sum (its writes ended first)."""
        a = (rng.offset - self.range.offset) // rng.element_size
        b = a + rng.numel
        if not any(lo < b and a < hi for lo, hi in self._written):
            return False
        self._settle(a, b)
        return True

    def _write(self, lo: int, buf: torch.Tensor, give_back: Callable[[], None]) -> None:
        """File elements [lo, lo + len(buf)) <- buf, asynchronously, in the tier's write window
        (tiers/nvme.py WriteWindow: a bounded number of bytes in flight over every file; buf is
        given back once written)."""
        rng = self.range.narrow(lo, buf.numel())
        self.nvme.read_ahead.forget(rng)
        handle = self.nvme.write(rng, buf)
        self._writes.append((lo, lo + buf.numel(), self.nvme.write_window.add(
            handle, buf.numel() * buf.element_size(), give_back)))

    def _settle(self, lo: int, hi: int) -> None:
        """This file's writes of elements in [lo, hi) have ended (only those are waited for:
        the ones just issued for other elements stay in flight)."""
        mine = [w for w in self._writes if w[0] < hi and lo < w[1]]
        if mine:
            self._writes = [w for w in self._writes if not (w[0] < hi and lo < w[1])]
            wait_all([w for _, _, w in mine])

    def settle(self) -> None:
        """Every write in flight has ended (the first failure raised after all of them)."""
        writes, self._writes = self._writes, []
        wait_all([w for _, _, w in writes])  # each gives its buffer back, failed or not

    def sq_norm(self) -> float:
        self.settle()
        if self._exact:
            return sum(self._written.values())
        total = 0.0
        for lo, hi in self._written:
            total += host_kernels.grad_sq_norm(read_range(self.nvme, self.range.narrow(lo, hi - lo)))[0]
        return total

    def zero_unwritten(self) -> None:
        """Elements no piece reached since `clear` hold a stale gradient: write zeros there."""
        for lo, hi in uncovered(0, self.range.numel, list(self._written)):
            self.nvme.read_ahead.forget(self.range.narrow(lo, hi - lo))
            fill_range(self.nvme, self.range.narrow(lo, hi - lo), 0.0)
            self._written[(lo, hi)] = 0.0
        self.settle()

    def clear(self) -> None:
        self.settle()
        self.nvme.read_ahead.forget(self.range)
        self._written = {}
        self._exact = True


class NvmeSlots:
    """An nvme part's master and optimizer state files, in two slots under the speculative step
    ([Note: the speculative step] in parts/speculation.py): `live` is the part's state (what the
    stream reads, checkpoints save and a resume loads); a speculative stream writes the other
    slot, which becomes live at commit and is forgotten at a rollback. Without speculation there
    is one slot and the stream writes in place."""

    def __init__(self, master: FileRange):
        self.masters: list[FileRange | None] = [master, None]
        self.states: list[dict[str, FileRange]] = [{}, {}]
        self.live = 0
        self.target = 0  # the slot the running / next stream writes

    @property
    def two(self) -> bool:
        return self.masters[1] is not None

    def add_second(self, nvme: NvmeTier, name: str) -> None:
        """Reserve the second slot (the same files' sizes and dtypes, kind "restores" in the
        ledger: bf16 master / state files have a bf16 second slot)."""
        first = self.masters[0]
        self.masters[1] = nvme.allocate(f"{name}/nvme_master.slot1", "restores", first.numel,
                                        first.dtype)
        self.states[1] = {k: nvme.allocate(f"{name}/nvme_state.{k}.slot1", "restores", r.numel,
                                           r.dtype) for k, r in self.states[0].items()}

    def write_other(self) -> None:
        """The next stream of this part writes the slot that is not live."""
        self.target = 1 - self.live

    def switch(self) -> None:
        self.live = self.target

    def stay(self) -> None:
        self.target = self.live


class NvmePart(PartSpan):
    """The nvme part: master, optimizer state and gradient in files on the nvme tier, the
    new weights in host memory (or in the shard's file); stepped a sub-group at a time by the
    streaming executor (parts/nvme_executor.py). A `KernelPart` (parts/kernel_part.py), as the
    host part is; both are a `PartSpan` (a range of the unit's optimizer range whose new weights
    leave through a `WeightsOut`), and with step_in_backward both hold a `HeldGradient` (an nvme
    part also with nvme_gradients 'host')."""

    tier = TierName.NVME

    def __init__(self, unit, span: OptimizerPart, *, master: FileRange, grad_files: list[FileRange],
                 out16: torch.Tensor | None, nvme: NvmeTier, home, in_place: bool, pinned: bool):
        super().__init__(unit, span.lo, span.hi, WeightsOut(home, out16, in_place, pinned))
        self.nvme = nvme
        self.slots = NvmeSlots(master)  # master and state: see NvmeSlots
        # one gradient file, two with the delayed update (the stream reads one, backward writes
        # the other; swap_grads flips `current`); none where held in memory (holds_nvme_gradients)
        grad_dtype = unit.layout.offload_grad_dtype
        refused = unit.name if grad_dtype != master.dtype else None  # 16-bit: one backward a step
        self.held = None if grad_files else HeldGradient(self.numel, grad_dtype, refused)
        self.gradients: list[FileGradient | HeldGradient] = (
            [FileGradient(nvme, g, refused) for g in grad_files] if grad_files else [self.held])
        self.current = 0
        # A weight shard on NVMe (offload_param device 'nvme'): no 16-bit copy of the part in RAM;
        # the stream writes each sub-group's new weights to the shard's file (`out_file`).
        self.out_file = home.range if out16 is None and isinstance(home, FileHome) else None
        self.streamed = False  # the running / last stream wrote the new weights to out_file
        self.steps = 0  # updates applied, the 1-based bias-correction count of the next one
        self.group = 0  # the optimizer param group whose hyper-parameters apply (bound later)
        self.gradient_in_flight: FileGradient | HeldGradient | None = None  # what the stream reads
        self.busy = None  # the executor worker that may write master/state (executors.WorkerDone)
        # bf16.bf16_optimizer_states: the state files' dtype; bf16.stochastic_rounding: the
        # kernel's rounding arguments, index_base the part's first element (each sub-group adds
        # its offset). Set by the engine, engine/bf16_state.py `configure_parts`, as for host parts.
        self.state_dtype = torch.float32
        self.rounding: dict = {}

    @property
    def master(self) -> FileRange:
        """The live master (what the stream reads)."""
        return self.slots.masters[self.slots.live]

    @property
    def state(self) -> dict[str, FileRange]:
        """The live optimizer state (what the stream reads)."""
        return self.slots.states[self.slots.live]

    @property
    def master_out(self) -> FileRange:
        """Where the running stream writes the new master (the live slot unless speculating)."""
        return self.slots.masters[self.slots.target]

    @property
    def state_out(self) -> dict[str, FileRange]:
        return self.slots.states[self.slots.target]

    def roll_back(self, skipped: bool) -> None:
        """The speculative update is forgotten (its slot stays unused); for a skipped step the
        new weights it wrote go back to the live master's (a redo writes them again)."""
        self.slots.stay()
        if not skipped:
            self.streamed = False
            return
        if self.out_file is not None:
            self.streamed = False
            self.out.home.copy_(self.master_values())
        elif self.out16 is not None:
            self.out16.copy_(read_range(self.nvme, self.master))

    def begin_step(self, worker_done) -> None:
        """The stream steps this part next: counted, the gradient it reads taken, marked busy."""
        self.steps += 1
        self.gradient_in_flight = self.gradient
        self.busy = worker_done

    def swap_grads(self) -> None:
        """Delayed update: the stream reads this gradient; backward writes the other."""
        self.current = (self.current + 1) % len(self.gradients)

    def wait(self) -> None:
        if self.busy is not None:
            self.busy.wait()

    # ---- gradients in: a file (see [Note: gradients on NVMe]) -----------------------------------
    @property
    def gradient(self) -> FileGradient | HeldGradient:
        """The gradient the current backward writes and the next step reads."""
        return self.gradients[self.current]

    def take_grad(self, part: torch.Tensor, offset: int) -> None:
        self.gradient.add(part, offset)

    def settle(self) -> None:
        self.gradient.settle()

    def grad_sq_norm(self) -> torch.Tensor:
        return torch.tensor(self.gradient.sq_norm(), dtype=torch.float64, device=self.unit.device)

    def zero_grad(self) -> None:
        self.gradient.clear()

    def init_state(self, family: str, fill: float = 0.0) -> None:
        """The optimizer state files (zero-filled when reserved: DeepSpeed's fast_init)."""
        if self.state:
            return
        for key in STATE_NAMES[family]:
            self.slots.states[0][key] = self.nvme.allocate(f"{self.unit.name}/nvme_state.{key}",
                                                 "optimizer_state", self.numel, self.state_dtype)
            if fill:
                fill_range(self.nvme, self.state[key], fill)

    # ---- weights out -------------------------------------------------------------------------
    def master_values(self) -> torch.Tensor:
        self.wait()  # a delayed stream may still write the file
        return read_range(self.nvme, self.master)

    def write_weights(self) -> None:
        if self.out_file is None:  # the stream wrote host memory: out16 -> the weights' home
            return self.out.write(None)
        if self.streamed:  # the stream wrote them: only a read-ahead buffer may be stale now
            self.streamed = False
            self.out.home.written_elsewhere()
        else:  # a load: the masters, rounded, to the file
            self.out.home.copy_(self.master_values())

    def absorb(self, new: torch.Tensor) -> None:
        """Compute weights were edited: carry changed elements into the master file."""
        self.wait()
        new = new.to("cpu")
        master = read_range(self.nvme, self.master)
        changed = new != master.to(new.dtype)
        if bool(changed.any()):
            master[changed] = new[changed].to(master.dtype)
            self.nvme.write(self.master, master).wait()
        if self.out16 is not None:
            self.out.absorb(changed, new)
        else:  # the file is the only 16-bit copy
            self.out.home.copy_(new)
