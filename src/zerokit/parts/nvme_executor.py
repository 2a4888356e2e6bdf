"""The streaming NVMe executor: ZeRO-Infinity's optimizer step over the nvme parts.

[Note: streaming the optimizer]
Each unit's nvme part (parts/nvme.py) keeps its master, optimizer state and gradient in
files (fp32, or bf16 with bf16.bf16_master_weights_and_grads / bf16_optimizer_states: the buffer
sets then hold bf16 too, and a sub-group moves 2 bytes per element per buffer each way) (the gradient held in host memory instead with step_in_backward or nvme_gradients 'host',
parts/held_gradient.py) and
its new weights in host memory (in its shard's file when that is on NVMe). The step cuts every
stepped part into sub-groups of `sub_group_size` elements (sector-aligned: StreamSettings.group_numel) and streams them through `buffer_count`
host buffer sets (a master, a gradient unless held, a 16-bit output when weights go to files, and
one buffer per state tensor each): sub-group j uses set j % buffer_count. For
sub-group i:
    read    i + 1 .. i + ahead are already being read (pipeline_read; ahead = buffer_count - 2,
            leaving one set for the write of i - 1), or i is read now (no pipeline_read)
    update  the fused host kernel (the one HostExecutor runs: parts/executors.py kernel_for)
            on the set's master, state and gradient, writing the new weights
            into the part's `out16` slice (for fp32 compute, a copy of the new master); where
            the unit's weight shard is a file, into the set's own 16-bit buffer, written to that
            file with the rest of the sub-group (no 16-bit copy of the part stays in RAM)
    write   master and state go back to their file ranges; waited when the set is needed again
            (pipeline_write) or at once
The kernel and the arithmetic are those of the host part, so a run with the optimizer on NVMe gives
the weights a run with it in host memory gives, bit for bit; stochastic rounding too, since each
sub-group passes its first element's index in the unit's flat index space (`index_base`) and the
random bits depend on nothing else but the seed and the step (zerokit/optim/rounding.py). The stream runs on the host
executor's worker thread (the executor is a HostExecutor whose `_run` streams): joined in
`finish`, or, with the delayed update, at the next step's `before_step`, so that it overlaps that
step's forward and backward (each part then has two gradient files: the stream reads one while
backward writes the other). The I/O engine's own threads overlap the kernel.

The engine counts each step's NVMe I/O, the stream's and the weights' (Engine._record_io); the
stream's own wall time is `stream_s`.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from zerokit.parts.nvme import FileGradient, NvmePart
from zerokit.parts.held_gradient import HeldGradient, host_buffer
from zerokit.parts.kernel_part import STATE_NAMES, KernelOperands
from zerokit.parts.executors import HostExecutor, PartFeed
from zerokit.io.aio import wait_all
from zerokit.io.buffers import SECTOR_ELEMENTS
from zerokit.policy import PlacementPolicy
from zerokit.tier_names import TierName
from zerokit.tiers.nvme import NvmeHandle, NvmeTier


@dataclasses.dataclass(frozen=True)
class StreamSettings:
    """offload_optimizer's nvme keys and zero_optimization.sub_group_size."""

    sub_group_size: int
    buffer_count: int = 4
    pipeline_read: bool = False
    pipeline_write: bool = False
    gradients_in_files: bool = True  # False where every part holds its gradient in host memory
    weights_in_files: bool = False  # offload_param device 'nvme': new 16-bit weights go to files

    @property
    def group_numel(self) -> int:
        """Elements per sub-group: sub_group_size rounded down to a multiple of SECTOR_ELEMENTS
        (where it is at least that).

        [Note: sector-aligned sub-groups]
        A sub-group's reads and writes go between a 4096-aligned host buffer and its file ranges
        at byte offset lo x element size. O_DIRECT moves a block straight only where the file
        offset and the address agree modulo 4096 (io/aio.py [Note: file residue]); otherwise
        every block is staged through a bounce buffer on the I/O engine's thread pool, and a
        staged write reads its partial edge sectors back first. With sub_group_size 10,000,000
        (bench_infinity's), an fp32 file's sub-groups sat at residues 2560 j mod 4096: 7 in 8
        of them were staged. Rounded to 2048 elements every sub-group starts on a sector in every
        dtype. The update is elementwise, so the cut changes no bit."""
        size = self.sub_group_size
        return size // SECTOR_ELEMENTS * SECTOR_ELEMENTS if size >= SECTOR_ELEMENTS else size

    @property
    def read_ahead(self) -> int:
        """Sub-groups read beyond the one updating."""
        if not self.pipeline_read:
            return 0
        return max(1, self.buffer_count - 2) if self.pipeline_write else self.buffer_count - 1


class _BufferSet:
    """One sub-group's host buffers, in the files' dtypes (master, gradient and state each its
    own: placement.master_dtype, gradient_dtype and state_dtype)."""

    def __init__(self, numel: int, names: tuple[str, ...], grad_dtype: torch.dtype | None,
                 out_dtype: torch.dtype | None, master_dtype: torch.dtype = torch.float32,
                 state_dtype: torch.dtype = torch.float32):
        self.master = host_buffer(numel, master_dtype)
        # read only, never written back; none where the kernel reads a held gradient
        self.grad = host_buffer(numel, grad_dtype) if grad_dtype is not None else None
        # a sub-group's new 16-bit weights on their way to a shard file (weights on NVMe)
        self.out16 = host_buffer(numel, out_dtype) if out_dtype is not None else None
        self.state = {k: host_buffer(numel, state_dtype) for k in names}
        self.reads: list[NvmeHandle] = []
        self.writes: list[NvmeHandle] = []

    @property
    def nbytes(self) -> int:
        bufs = [self.master, self.grad, self.out16, *self.state.values()]
        return sum(b.numel() * b.element_size() for b in bufs if b is not None)

    def wait_writes(self) -> None:
        """Every write of the set has ended when this returns, the first failure raised after:
        one left in flight would fail again later, in whatever waits for the I/O engine."""
        writes, self.writes = self.writes, []
        wait_all(writes)


class NvmeExecutor(HostExecutor):
    """Steps every unit's nvme part, streaming sub-groups (see [Note: streaming the optimizer]).

    The host executor's machinery (parts/executors.py: the worker thread, its states, the
    delayed update and its write-back) with `_run` streaming the parts from their files.
    """

    tier = TierName.NVME

    def __init__(self, units: list, nvme: NvmeTier, settings: StreamSettings, ledger,
                 placement: PlacementPolicy):
        super().__init__(units, placement)
        self.nvme, self.settings, self.ledger = nvme, settings, ledger
        self._sets: list[_BufferSet] = []
        self.stream_s = 0.0  # the last stream's wall time

    def enable_speculation(self) -> None:
        """step_in_backward: each part's second file slot (parts/nvme.py NvmeSlots; see
        parts/speculation.py). After bind."""
        for s in self.parts:
            s.slots.add_second(self.nvme, s.unit.name)

    @property
    def parts(self) -> list[NvmePart]:
        return self.shards

    def _run(self, feed: PartFeed, groups: list[dict], coef: float) -> None:
        """On the worker thread: the stream, timed."""
        start = time.perf_counter()
        try:
            self._stream(feed, groups, coef)
        except BaseException:
            self._drain()
            raise
        self.stream_s = time.perf_counter() - start

    def close(self) -> None:
        """The engine is released: the update in flight ends, the swap files are removed."""
        super().close()
        self._sets = []
        self.nvme.close()

    # ---- streaming ---------------------------------------------------------------------------
    def _buffer_sets(self, numel: int) -> list[_BufferSet]:
        if not self._sets or self._sets[0].master.numel() < numel:
            # 16-bit weights to files: the shard files' dtype (fp32 compute writes the master)
            out = next((p.out_file.dtype for p in self.parts if p.out_file is not None
                        and p.out_file.dtype != torch.float32), None)
            first = self.parts[0]  # one master / gradient / state dtype for every part (the placement's)
            # the gradient files' dtype; None where every part holds its gradient in memory
            grad = next((p.gradient.range.dtype for p in self.parts
                         if isinstance(p.gradient, FileGradient)), None)
            self._sets = [_BufferSet(numel, STATE_NAMES[self.family], grad,
                                     out, first.master.dtype, first.state_dtype)
                          for _ in range(self.settings.buffer_count)]
            self.ledger.hold_bytes("nvme_executor/buffer_sets", "buffers", TierName.HOST,
                                   sum(b.nbytes for b in self._sets))
        return self._sets

    def _stream(self, feed: PartFeed, groups: list[dict], coef: float) -> None:
        size = self.settings.group_numel
        subs: list[tuple[NvmePart, int, int]] = []  # the feed's parts cut into sub-groups so far
        taken = 0  # parts of the feed cut so far

        def sub(j: int, wait: bool):
            """Sub-group j, cutting the feed's next parts as needed; None if there is none (yet)."""
            nonlocal taken
            while j >= len(subs):
                s = feed.get(taken, wait)
                if s is None:
                    return None
                taken += 1
                s.gradient_in_flight.zero_unwritten()
                subs.extend((s, lo, min(size, s.numel - lo)) for lo in range(0, s.numel, size))
            return subs[j]

        if sub(0, wait=True) is None:
            return
        sets = self._buffer_sets(min(size, max(p.numel for p in self.parts)))
        count, ahead = len(sets), self.settings.read_ahead
        read_next = 0

        def submit_read(j: int) -> None:
            s, lo, n = subs[j]
            b = sets[j % count]
            b.wait_writes()  # the set's previous sub-group is on disk before we overwrite it
            b.reads = [self.nvme.read(s.master.narrow(lo, n), b.master[:n])]
            grad = s.gradient_in_flight
            if isinstance(grad, FileGradient):  # held in memory: the kernel reads it there
                b.reads.append(self.nvme.read(grad.range.narrow(lo, n), b.grad[:n]))
            b.reads += [self.nvme.read(s.state[k].narrow(lo, n), b.state[k][:n]) for k in b.state]

        i = 0
        while sub(i, wait=True) is not None:
            # sub-group i itself, then those already known up to `ahead` beyond (never waiting
            # for backward to offer more: the next loop reads them)
            while read_next <= i + ahead and sub(read_next, wait=read_next == i) is not None:
                submit_read(read_next)
                read_next += 1
            s, lo, n = subs[i]
            b = sets[i % count]
            for h in b.reads:
                h.wait()
            b.reads = []
            if lo == 0:  # the part's first sub-group: a speculative update writes the other slot
                self._before_part(s)
            self._update(s, lo, n, b, groups[s.group], coef)
            b.writes = [self.nvme.write(s.master_out.narrow(lo, n), b.master[:n])]
            b.writes += [self.nvme.write(s.state_out[k].narrow(lo, n), b.state[k][:n]) for k in b.state]
            if s.out_file is not None:  # the new weights straight to the shard's file
                new = b.master if s.out_file.dtype == torch.float32 else b.out16
                b.writes.append(self.nvme.write(s.out_file.narrow(lo, n), new[:n]))
                s.streamed = True
            if not self.settings.pipeline_write:
                b.wait_writes()
            if lo + n == s.numel:  # the part's last sub-group
                feed.finished()
            i += 1
        for b in sets:
            b.wait_writes()

    def _update(self, s: NvmePart, lo: int, n: int, b: _BufferSet, group: dict,
                coef: float) -> None:
        if s.out16 is not None:
            out = s.out16[lo:lo + n]
        else:  # weights on NVMe: the set's buffer, written to the file after (None: fp32)
            out = b.out16[:n] if b.out16 is not None else None
        sixteen = out is not None and out.dtype != torch.float32
        grad = s.gradient_in_flight
        rounding = dict(s.rounding)
        if rounding:  # the sub-group's first element in the unit's flat index space
            rounding["index_base"] += lo
        ops = KernelOperands(b.master[:n],
                             grad.values(lo, n) if isinstance(grad, HeldGradient) else b.grad[:n],
                             {k: v[:n] for k, v in b.state.items()}, out if sixteen else None, s.steps,
                             rounding)
        self._step_fn(ops, group, coef)
        if out is not None and not sixteen:  # fp32 compute: the new weights are the new master
            out.copy_(ops.master)

    def _drain(self) -> None:
        for b in self._sets:
            for h in b.reads + b.writes:
                try:
                    h.wait()
                except OSError:
                    pass
            b.reads, b.writes = [], []


def buffer_set_bytes(settings: StreamSettings, family: str | None, largest_part: int,
                     master_dtype: torch.dtype = torch.float32,
                     state_dtype: torch.dtype = torch.float32,
                     grad_dtype: torch.dtype | None = None) -> int:
    """Host bytes of the stream's buffer sets: buffer_count x (master + gradient + state) x a
    sub-group (no gradient where gradients are held, not in files), each in its files' dtype
    (the gradient's: grad_dtype, or the master's)."""
    states = len(STATE_NAMES.get(family or "adam", ("a", "b")))
    master = torch.empty(0, dtype=master_dtype).element_size()
    grad = torch.empty(0, dtype=grad_dtype or master_dtype).element_size()
    state = torch.empty(0, dtype=state_dtype).element_size()
    per_element = (master + grad * settings.gradients_in_files + state * states
                   + 2 * settings.weights_in_files)
    return settings.buffer_count * per_element * min(settings.group_numel, largest_part)
