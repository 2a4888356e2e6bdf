"""A stage-3 weight shard on NVMe: the file that holds it and the host buffer it is read through.

[Note: weight shards on NVMe]
With offload_param device 'nvme' a unit's compute-dtype shard (the `shard` record, policy/layout.py)
is a file range on the nvme tier, and the unit's `shard` tensor is a host buffer (the
`shard_buffer` record) whose storage exists only while the values pass through it to a gather:
its untyped storage is resized to 0 bytes when the gather has copied it, and given fresh aligned
storage (`set_`, so the tensor stays the unit's `shard`) when a read needs it. The buffer is
(`ShardResidency`, moved through its table in states.py: an illegal move raises)
    EMPTY     no storage; the file holds the values
    READING   a read of the file into it is in flight (the scheduler's read-ahead, or a gather)
    RESIDENT  it holds the file's values, until the gather has copied them (`drop_clean`)
Writers never go through the buffer: the optimizer parts' `home` is a `FileHome`, a view of the
file with a tensor's `copy_`, so a host or nvme part writes its new weights from the host buffer
the kernel wrote them in (out16, or the fp32 master) straight to the file, asynchronously, and a
device part's are staged through a temporary host copy and written at once. The writes are
waited at the end of the step (`settle`, from Unit.wait_weights) and before any read of the file;
the step therefore holds no copy of the shards in host memory. Every wait on the file raises
AioError naming the file (a deleted one: "opening", a truncated one: "short file").

[Note: reading into the weights]
On a CPU device the buffer is a copy the gather makes for nothing: the unit's full weights
(`flat`) are host memory too, and its own range of them is where the values end up. There the
unit hands its shard its own range (`slot`): `flat` keeps one sector-aligned address for the
unit's life, a release hands its pages back to the kernel (huge_pages.release) instead of
freeing the storage, and a read the unit asks for (`fetch(into_slot=True)`, only while its
weights are released or being re-gathered) goes from the file straight into that range. The
residency table is the same; the values are in `target`, the buffer or the slot. Counted alike
in the ledger ("buffers" while read ahead, the unit's "weights" once gathered), so nothing the
budget sees changes; what goes is one copy of every unit per gather (at 1B, with bf16 weights,
2 GB a forward and again a backward, on the compute thread) and the buffer's own pages.
A read for anyone else (`shard_values`, a gathered unit's values) still uses the buffer.
"""
from __future__ import annotations

import torch

from zerokit.tier_names import TierName
from zerokit.states import ShardResidency, move
from zerokit.io import huge_pages
from zerokit.io.buffers import aligned_empty
from zerokit.tiers.nvme import FileRange, NvmeHandle, NvmeTier


class FileHome:
    """Elements of a weight shard's file, written like a tensor: `home.copy_(src)` (a part's
    write-back), `home[a:b]` (a part's piece of the shard)."""

    def __init__(self, shard: "NvmeShard", rng: FileRange):
        self._shard, self.range = shard, rng

    def __getitem__(self, index: slice) -> "FileHome":
        start, stop, step = index.indices(self.range.numel)
        if step != 1:
            raise ValueError("a FileHome is sliced contiguously")
        return FileHome(self._shard, self.range.narrow(start, max(0, stop - start)))

    def numel(self) -> int:
        return self.range.numel

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> "FileHome":
        self._shard.write(self.range, src)
        return self

    def written_elsewhere(self) -> None:
        """The file's elements were written without `copy_` (the NVMe stream): a buffer holding
        the old values is stale."""
        self._shard.drop_stale()


class NvmeShard:
    """One unit's weight shard file and its host buffer (see [Note: weight shards on NVMe])."""

    def __init__(self, nvme: NvmeTier, file: FileRange, buffer: torch.Tensor, ledger,
                 slot: torch.Tensor | None = None):
        self.nvme, self.file, self.buffer, self.ledger = nvme, file, buffer, ledger
        # the unit's own range of its weights, read into in place ([Note: reading into the weights])
        self.slot = slot
        self.target = buffer  # where the values are, or are being read to: the buffer or the slot
        self._nbytes = buffer.numel() * buffer.element_size()
        self._pinned = buffer.is_pinned()
        self._read: NvmeHandle | None = None
        self._writes: list[tuple[NvmeHandle, torch.Tensor]] = []  # with the source they read
        self._release = ledger.transient("buffers", buffer, tier=TierName.HOST)
        self.residency = ShardResidency.RESIDENT
        self.home = FileHome(self, file)

    # ---- reads, through the host buffer ------------------------------------------------------
    @property
    def in_host_memory(self) -> bool:
        """The buffer holds storage (a read ahead, or values on their way to a gather)."""
        return self.residency is not ShardResidency.EMPTY

    def fetch(self, into_slot: bool = False) -> None:
        """Start reading the file into the buffer (the first level of the stage-3 prefetch), or
        into the unit's own range of its weights where it has one and asks for it (into_slot:
        the unit's weights are released or being gathered anew)."""
        if self.residency is not ShardResidency.EMPTY:
            return
        self.settle()  # the last step's writes land before the file is read
        if into_slot and self.slot is not None:
            self.target = self.slot
            self._release = self.ledger.transient("buffers", self.slot, tier=TierName.HOST)
        else:
            self.target = self.buffer
            if self.buffer.untyped_storage().nbytes() == 0:
                self._allocate()
                self._release = self.ledger.transient("buffers", self.buffer, tier=TierName.HOST)
        self._read = self.nvme.read(self.file, self.target)
        self._move(ShardResidency.READING)

    def _allocate(self) -> None:
        """Fresh storage under the buffer, 4 KiB-aligned (2 MiB, on huge pages, where large), so
        the read reaches the disk by O_DIRECT: `resize_` would give torch's 64-byte alignment,
        which the I/O engine reads through a bounce buffer, one block at a time."""
        fresh = aligned_empty(self._nbytes, pin=self._pinned)
        self.buffer.set_(fresh.untyped_storage(), fresh.storage_offset() // self.buffer.element_size(),
                         self.buffer.shape)

    def ready(self, into_slot: bool = False) -> torch.Tensor:
        """`target` (the buffer, or the unit's slot), holding the file's values: waits for the
        read in flight, or reads now (into the slot if into_slot, as `fetch`)."""
        self.fetch(into_slot)
        if self.residency is ShardResidency.READING:
            handle, self._read = self._read, None
            phase, self.ledger.phase = self.ledger.phase, "io wait"  # the timeline's phase
            try:
                handle.wait()
            except BaseException:
                self._free()  # the values are not in the buffer: read again next time
                raise
            finally:
                self.ledger.phase = phase
            self._move(ShardResidency.RESIDENT)
        return self.target

    def drop_stale(self) -> None:
        """Someone else wrote the file: the buffer's values (or a read in flight) are old."""
        if self.residency is ShardResidency.READING:
            self.ready()
        if self.residency is ShardResidency.RESIDENT:
            self._free()

    def drop_clean(self) -> None:
        """Free the buffer once a gather copied it (the file holds its values); values read
        into the slot are the gathered weights now: the unit keeps its pages."""
        if self.residency is ShardResidency.RESIDENT:
            self._free(keep_slot=True)

    def _free(self, keep_slot: bool = False) -> None:
        if self.target is self.buffer:
            self.buffer.untyped_storage().resize_(0)
        elif not keep_slot:  # a read ahead into the released weights, not gathered: pages back
            huge_pages.release(self.slot.data_ptr(), self.slot.numel() * self.slot.element_size())
        self.target = self.buffer
        if self._release is not None:
            self._release()
            self._release = None
        self._move(ShardResidency.EMPTY)

    def _move(self, new: ShardResidency) -> None:
        self.residency = move(self.residency, new, f"weight shard {self.file.owner!r} host buffer")

    # ---- writes, straight to the file --------------------------------------------------------
    def write(self, rng: FileRange, src: torch.Tensor) -> None:
        """File elements `rng` <- src (converted to the shard's dtype as a tensor copy_ would).
        A contiguous host tensor of that dtype is written asynchronously (it must not change
        until `settle`: the parts' out16 and masters do not before the next step); anything else
        is staged through a temporary host copy and written at once, so no staging outlives it."""
        if rng.numel == 0:
            return
        if self.residency is ShardResidency.READING:  # a read in flight must not race the write
            self.ready()
        # The buffer's own values going to the file (construction) keep it current; any other
        # write leaves it stale, so it goes.
        own = (self.residency is ShardResidency.RESIDENT and src.data_ptr() == self.target.data_ptr()
               and src.numel() == self.target.numel())
        if self.residency is ShardResidency.RESIDENT and not own:
            self._free()
        src = src.detach().reshape(-1)
        direct = src.device.type == "cpu" and src.dtype == rng.dtype and src.is_contiguous()
        if not direct:
            src = src.to(device="cpu", dtype=rng.dtype).contiguous()
        handle = self.nvme.write(rng, src)
        if direct and not own:
            self._writes.append((handle, src))
        else:
            handle.wait()

    def write_values(self, values: torch.Tensor) -> None:
        """The whole file <- values, synchronously."""
        self.write(self.file, values)
        self.settle()

    def settle(self) -> None:
        """The writes in flight land (the end of a step, before a read)."""
        writes, self._writes = self._writes, []
        error = None
        for handle, _src in writes:
            try:
                handle.wait()
            except OSError as e:  # wait for every write before raising the first failure
                error = error or e
        if error is not None:
            raise error

    def close(self) -> None:
        """Waits for I/O in flight (errors dropped: the file is going) and frees the buffer."""
        for handle in [h for h, _ in self._writes] + ([self._read] if self._read else []):
            try:
                handle.wait()
            except OSError:
                pass
        self._writes, self._read = [], None
        if self.residency is not ShardResidency.EMPTY:
            self._free()
