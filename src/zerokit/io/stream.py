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
import os
from typing import Callable, Iterator

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


def _chunk_starts(offset: int, nbytes: int, chunk: int) -> list[int]:
    """Where each chunk of [offset, offset + nbytes) starts: at offset, then on chunk multiples
    of the file (block boundaries, so per-block checksums split cleanly between chunks)."""
    return [offset] + list(range((offset // chunk + 1) * chunk, offset + nbytes, chunk))


def _lease(pool: BufferPool, start: int, busy: bool) -> torch.Tensor | None:
    """A buffer for the chunk at `start` (same residue, so O_DIRECT takes it as it is). Blocks
    only when the caller has nothing in flight: otherwise a pool shared with other users just
    means a shallower ring, never a wait on ourselves (None: finish one of yours first)."""
    try:
        return pool.acquire(residue=start % ALIGN, timeout=0 if busy else None)
    except TimeoutError:
        return None


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
    starts = _chunk_starts(offset, nbytes, chunk)
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

    pending = iter(starts)
    next_start = next(pending, None)
    try:
        while next_start is not None or in_flight:
            while next_start is not None and len(in_flight) < pool.capacity:
                buf = _lease(pool, next_start, bool(in_flight))
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


class CompletedWrite:
    """What write_chunks returns: the write is done; wait() and done() as on an IOHandle."""

    def __init__(self, path: str, nbytes: int, checksums: list[int] | None):
        self.path, self.nbytes, self.checksums = path, nbytes, checksums

    def done(self) -> bool:
        return True

    def wait(self) -> int:
        return self.nbytes


def write_chunks(aio: AsyncIO, path: str, nbytes: int, pool: BufferPool,
                 fill: Callable[[int, torch.Tensor], None], *, offset: int = 0,
                 checksums: bool = False, fsync: bool = False) -> CompletedWrite:
    """Writes bytes [offset, offset + nbytes) of path through the pool's buffers, the
    counterpart of read_chunks: fill(position, buffer) puts the bytes from offset + position
    into buffer (a device -> host copy, say) while the chunks before it are being written.
    Returns once every byte is written (durable with fsync), with one checksum per block of the
    whole range when asked. A failure, of a write or of fill, raises after the writes in flight
    are drained; every buffer goes back to the pool."""
    chunk = chunk_bytes(aio, pool)
    end = offset + nbytes
    in_flight: collections.deque[tuple[torch.Tensor, IOHandle]] = collections.deque()
    crcs: list[int] = []

    def finish_oldest() -> None:
        view, h = in_flight.popleft()
        try:
            h.wait()
        finally:
            pool.release(view)
        if checksums:
            crcs.extend(h.checksums)

    if nbytes <= 0:  # the file exists afterwards, as after an empty AsyncIO.write
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        except OSError as e:
            raise AioError(e.errno, "opening", path) from None
        return CompletedWrite(path, 0, [] if checksums else None)
    try:
        for start in _chunk_starts(offset, nbytes, chunk):
            buf = _lease(pool, start, bool(in_flight))
            while buf is None:
                finish_oldest()
                buf = _lease(pool, start, bool(in_flight))
            view = buf[:min(end, (start // chunk + 1) * chunk) - start]
            try:
                fill(start - offset, view)
                h = aio.write(path, view, start, checksums=checksums)
            except BaseException:
                pool.release(view)
                raise
            in_flight.append((view, h))
        while in_flight:
            finish_oldest()
    finally:
        for view, h in in_flight:
            try:
                h.wait()
            except AioError:
                pass
            pool.release(view)
    if fsync:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError as e:
            raise AioError(e.errno, "syncing", path) from None
        finally:
            os.close(fd)
    return CompletedWrite(path, nbytes, crcs if checksums else None)
