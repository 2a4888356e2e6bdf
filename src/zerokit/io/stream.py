"""Streaming a file range through a small ring of pool buffers, in order.

ZeRO-Infinity's NVMe -> host -> device path never needs a host copy of a whole tensor: the bytes
go through a few fixed staging buffers, each consumed (copied to the device, or updated by the
optimizer) while the next ones are read. `read_chunks` keeps the pool's buffers busy with reads
and hands them out one at a time, in file order.

It is also the fastest way to read here: the disk's bytes are copied into the guest's memory
below the VM, and a ring of a few MiB stays in cache where a fresh 2 GiB buffer does not. Same
engine, 2 GiB, 1 MiB blocks, depth 8: 2.9-3.2 GB/s through an 8 MiB ring, 2.1-2.2 into one
buffer (docs/nvme.md, "Reading through a ring"). fio measures the disk that way too: its buffers
are block_size * iodepth bytes, reused.
"""
from __future__ import annotations

import collections
from typing import Iterator

import torch

from zerokit.io.aio import AioConfig, AioError, AsyncIO, IOHandle
from zerokit.io.buffers import ALIGN, BufferPool


def ring_pool(config: AioConfig, pin: bool | None = None) -> BufferPool:
    """The default ring: queue_depth * thread_count blocks in all (fio's footprint, which stays
    in cache), in buffers of two blocks: half the hand-offs of one-block buffers, each a wake-up
    and some Python under the GIL, at the same depth and throughput."""
    blocks = config.queue_depth * config.thread_count
    per = 2 if blocks >= 4 else 1
    return BufferPool(per * config.block_size, blocks // per, pin=pin)


def chunk_bytes(aio: AsyncIO, pool: BufferPool) -> int:
    """The ring's chunk: the largest whole number of engine blocks a pool buffer holds, so every
    chunk starts on a block boundary of the file and its checksums are a slice of the range's."""
    block = aio.config.block_size
    if pool.buffer_bytes < block:
        raise ValueError(f"streaming needs pool buffers of at least one aio block "
                         f"({block} bytes), got buffer_bytes={pool.buffer_bytes}")
    return pool.buffer_bytes // block * block


def read_chunks(aio: AsyncIO, path: str, nbytes: int, pool: BufferPool, *, offset: int = 0,
                expected_checksums: list[int] | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """Yields (position, buffer) for bytes [offset, offset + nbytes) of path, in order: buffer
    holds the bytes from offset + position on. It goes back to the pool when the next chunk is
    asked for, so consume it (or copy it) first. Up to pool.capacity reads are in flight; with
    expected_checksums (one per block of the whole range, as AsyncIO.write returned them) each
    chunk is verified. A failure raises AioError after the reads in flight are drained; leaving
    the loop early drains them too."""
    if nbytes <= 0:
        return
    chunk = chunk_bytes(aio, pool)
    block = aio.config.block_size
    end = offset + nbytes
    starts = [offset] + list(range((offset // chunk + 1) * chunk, end, chunk))
    in_flight: collections.deque[tuple[int, torch.Tensor, IOHandle]] = collections.deque()

    def submit(start: int, buf: torch.Tensor) -> None:
        stop = min(end, (start // chunk + 1) * chunk)
        view = buf[:stop - start]
        expected = None
        if expected_checksums is not None:
            first = start // block - offset // block
            expected = expected_checksums[first:first + aio.num_blocks(stop - start, start)]
        try:
            h = aio.read(path, view, start, expected_checksums=expected)
        except BaseException:
            pool.release(buf)
            raise
        in_flight.append((start, view, h))

    def try_acquire(start: int) -> torch.Tensor | None:
        # Block for a buffer only when nothing of ours is in flight: otherwise a pool shared
        # with other users just means a shallower ring, never a wait on ourselves.
        try:
            return pool.acquire(residue=start % ALIGN, timeout=None if not in_flight else 0)
        except TimeoutError:
            return None

    pending = iter(starts)
    next_start = next(pending, None)
    try:
        while next_start is not None or in_flight:
            while next_start is not None and len(in_flight) < pool.capacity:
                buf = try_acquire(next_start)
                if buf is None:
                    break
                submit(next_start, buf)
                next_start = next(pending, None)
            start, view, h = in_flight.popleft()
            try:
                h.wait()
            except AioError:
                pool.release(view)
                raise
            try:
                yield start - offset, view
            finally:
                pool.release(view)
    finally:
        for _, view, h in in_flight:
            try:
                h.wait()
            except AioError:
                pass
            pool.release(view)
