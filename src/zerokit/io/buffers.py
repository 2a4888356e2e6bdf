"""Host buffers for O_DIRECT: aligned allocation and a pool of reusable fixed-size buffers.

O_DIRECT moves bytes by DMA straight between the disk and user memory, so the memory address,
file offset and length must be multiples of the logical block size; 4096 covers every device we
meet. A buffer whose address has the same residue modulo 4096 as the file offset it maps to is
just as good (only its partial head and tail sectors are staged), which is why allocation takes a
`residue`. The pool exists so that steady-state swapping allocates nothing: buffers are made once,
pinned when a GPU is present (so host<->device copies can be asynchronous), and leased out.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch

from zerokit.io import huge_pages

ALIGN = 4096
# Elements of the narrowest dtype in a file (16-bit) per 4 KiB: a file range starting at a multiple
# of this many elements starts on a sector in every dtype zerokit writes (2 or 4 bytes each).
SECTOR_ELEMENTS = ALIGN // 2


def pin_default() -> bool:
    """Pin host buffers only where a GPU can use them; pinning never becomes a requirement."""
    return torch.cuda.is_available()


def aligned_empty(nbytes: int, *, alignment: int = ALIGN, residue: int = 0,
                  pin: bool = False) -> torch.Tensor:
    """A 1-D uint8 tensor of nbytes whose address is `residue` modulo `alignment`.

    The view keeps its over-allocated base alive, so it can be handed around like any tensor.
    An unpinned buffer of at least huge_pages.MIN_BYTES starts on a 2 MiB boundary (plus the
    residue) and asks for transparent huge pages: fewer, larger device requests per block
    (see huge_pages.py). Pinned memory is left as the GPU runtime allocated it.
    """
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    if not 0 <= residue < alignment:
        raise ValueError(f"residue must be in [0, {alignment}), got {residue}")
    huge = not pin and nbytes >= huge_pages.MIN_BYTES and alignment <= huge_pages.HUGE_PAGE
    step = huge_pages.HUGE_PAGE if huge else alignment
    base = torch.empty(nbytes + 2 * step, dtype=torch.uint8, pin_memory=pin)
    start = (residue - base.data_ptr()) % step
    if huge:  # before anything touches the pages, or they stay 4 KiB
        huge_pages.advise(base.data_ptr() + start - residue, nbytes + residue)
    return base[start:start + nbytes]


def is_aligned(t: torch.Tensor, alignment: int = ALIGN) -> bool:
    return t.data_ptr() % alignment == 0


class BufferPool:
    """`count` buffers of `buffer_bytes` each, allocated once and leased by acquire/release.

    The buffers are slices of one allocation: a pool of 8 MiB or more then gets huge pages
    (aligned_empty), so each 1 MiB block is one device request, where separately allocated
    1 MiB buffers would each be 256 scattered 4 KiB pages (measured: 1.2 against 2.5 GB/s
    streaming reads, docs/nvme.md). acquire blocks while every buffer is leased (back-pressure
    on prefetch rather than unbounded memory); `allocations` counts the buffers ever made, so a
    test can assert that steady state allocates nothing.
    """

    def __init__(self, buffer_bytes: int, count: int, *, alignment: int = ALIGN,
                 pin: bool | None = None):
        if buffer_bytes <= 0 or count <= 0:
            raise ValueError(f"BufferPool needs buffer_bytes > 0 and count > 0, "
                             f"got {buffer_bytes} and {count}")
        self.buffer_bytes = buffer_bytes
        self.alignment = alignment
        self.pinned = pin_default() if pin is None else pin
        # The extra `alignment` bytes let a lease start at any residue and still hold
        # buffer_bytes.
        self._stride = -(-(buffer_bytes + alignment) // alignment) * alignment
        self._slab = aligned_empty(self._stride * count, alignment=alignment, pin=self.pinned)
        self._count = count
        self.allocations = count
        self._free = list(range(count))
        self._cond = threading.Condition()

    def _index(self, buf: torch.Tensor) -> int | None:
        if buf.untyped_storage().data_ptr() != self._slab.untyped_storage().data_ptr():
            return None
        return (buf.data_ptr() - self._slab.data_ptr()) // self._stride

    @property
    def capacity(self) -> int:
        return self._count

    @property
    def free_count(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire(self, nbytes: int | None = None, *, residue: int = 0,
                timeout: float | None = None) -> torch.Tensor:
        nbytes = self.buffer_bytes if nbytes is None else nbytes
        if nbytes > self.buffer_bytes:
            raise ValueError(f"BufferPool lease of {nbytes} bytes exceeds its buffers of "
                             f"{self.buffer_bytes} bytes")
        if not 0 <= residue < self.alignment:
            raise ValueError(f"residue must be in [0, {self.alignment}), got {residue}")
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout=timeout):
                raise TimeoutError(f"no free buffer in the pool of {self.capacity} after "
                                   f"{timeout} s; release leased buffers or grow the pool")
            start = self._free.pop() * self._stride + residue  # the slab starts aligned
        return self._slab[start:start + nbytes]

    def release(self, buf: torch.Tensor) -> None:
        idx = self._index(buf)
        if idx is None:
            raise ValueError("BufferPool.release: the tensor is not a buffer of this pool")
        with self._cond:
            if idx in self._free:
                raise ValueError("BufferPool.release: buffer released twice")
            self._free.append(idx)
            self._cond.notify()

    def owns(self, buf: torch.Tensor) -> bool:
        return self._index(buf) is not None

    @contextmanager
    def lease(self, nbytes: int | None = None, *, residue: int = 0) -> Iterator[torch.Tensor]:
        buf = self.acquire(nbytes, residue=residue)
        try:
            yield buf
        finally:
            self.release(buf)
