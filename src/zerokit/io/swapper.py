"""TensorSwapper: tensors out to files and back by key, in a directory of its own.

Every key maps to one file holding its bytes at offset `pad` (see [Note: file residue] in
aio.py), plus in-memory metadata: shape, dtype, size and, optionally, one checksum per block.
States of a key, as `where(key)` reports them:

    "writing"     swap_out submitted, not yet waited          -> "nvme" or gone (failed)
    "nvme"        on disk only                                -> "prefetching"
    "prefetching" a read into a host buffer is in flight      -> "prefetched"
    "prefetched"  on disk and in a host buffer (swap_in takes it) -> "nvme"

A failed write removes its new file and keeps the key's previous version, if any; no other key is
touched. Every error is an AioError naming the path, the key and the offset.

The files are in `<directory>/zerokit-swap/rank<r>-<pid>-<hex>/`, a directory claimed for this
swapper while it lives ([Note: swap directory claims] in swap_directory.py): two swappers, or a
swapper and an engine, on one directory never touch each other's files, and what a dead run of
this rank left there is removed at start (`stale_files`).
"""
from __future__ import annotations

import dataclasses
import errno
import itertools
import os
import re
import threading
from typing import Iterator

import torch

from zerokit.io.aio import AioConfig, AioError, AsyncIO, IOHandle
from zerokit.io.buffers import ALIGN, BufferPool, aligned_empty, pin_default
from zerokit.io.stream import CompletedWrite, read_chunks, ring_pool, write_chunks
from zerokit.io.swap_directory import SwapDirectory


@dataclasses.dataclass
class _Entry:
    path: str
    shape: torch.Size
    dtype: torch.dtype
    nbytes: int
    pad: int
    checksums: list[int] | None = None
    writing: IOHandle | None = None
    staged: torch.Tensor | None = None  # contiguous copy of a strided tensor, alive while written
    prefetch: tuple[torch.Tensor, IOHandle] | None = None


class TensorSwapper:
    def __init__(self, directory: str, *, rank: int = 0, config: AioConfig | None = None,
                 checksums: bool = False, fsync: bool = False, backend: str = "auto",
                 pool: BufferPool | None = None):
        # A directory of its own under <directory>/zerokit-swap, as the NVMe tier's: two swappers
        # on one directory never touch each other's files (io/swap_directory.py).
        self._claim = SwapDirectory(directory, rank, error=AioError)
        self.directory = self._claim.path
        self.stale_files = self._claim.stale_files
        try:
            self.aio = AsyncIO(config, backend=backend)
        except BaseException:
            self._claim.release()
            raise
        self.checksums = checksums
        self.fsync = fsync
        self.pool = pool
        self._ring: BufferPool | None = None  # staging for streamed reads, made on first use
        self._entries: dict[str, _Entry] = {}
        self._pending: dict[str, _Entry] = {}  # key -> the version being written
        self._disk_bytes = 0
        self._seq = itertools.count()
        self._lock = threading.RLock()
        self._closed = False

    # -- bookkeeping -------------------------------------------------------------------------
    @property
    def nvme_bytes(self) -> int:
        """Bytes this swapper holds in files (in-flight writes included): the ledger's nvme tier."""
        with self._lock:
            return self._disk_bytes

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(set(self._entries) | set(self._pending))

    def where(self, key: str) -> str:
        with self._lock:
            if key in self._pending:
                return "writing"
            e = self._get(key)
            if e.prefetch is None:
                return "nvme"
            return "prefetched" if e.prefetch[1].done() else "prefetching"

    def residency(self) -> dict[str, str]:
        return {k: self.where(k) for k in self.keys()}

    def path_of(self, key: str) -> str:
        with self._lock:
            return (self._pending.get(key) or self._get(key)).path

    def _get(self, key: str) -> _Entry:
        e = self._entries.get(key)
        if e is None:
            raise KeyError(f"no tensor swapped out under key {key!r} in {self.directory!r}")
        return e

    def _new_path(self, key: str) -> str:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:80]
        return os.path.join(self.directory, f"{safe}.{next(self._seq)}.swp")

    def _drop_file(self, e: _Entry) -> None:
        try:
            os.unlink(e.path)
        except FileNotFoundError:
            pass
        self._disk_bytes -= e.pad + e.nbytes

    # -- out -----------------------------------------------------------------------------------
    def swap_out(self, key: str, tensor: torch.Tensor, *, wait: bool = False
                 ) -> IOHandle | CompletedWrite:
        """Starts writing the tensor under key; do not modify it until the handle is waited.
        A device tensor goes out through the staging ring and is written when this returns."""
        if self._closed:
            raise RuntimeError(f"TensorSwapper at {self.directory!r} is closed")
        self._settle(key)
        if tensor.device.type != "cpu":
            return self._swap_out_streamed(key, tensor.contiguous())
        src = tensor.contiguous()
        staged = src if src is not tensor else None
        nbytes = src.numel() * src.element_size()
        e = _Entry(self._new_path(key), src.shape, src.dtype, nbytes, src.data_ptr() % ALIGN,
                   staged=staged)
        with self._lock:
            self._pending[key] = e
            self._disk_bytes += e.pad + nbytes
        try:
            h = self.aio.write(e.path, src.view(-1).view(torch.uint8) if nbytes else
                               src.view(-1), offset=e.pad, fsync=self.fsync,
                               checksums=self.checksums)
        except AioError as err:
            self._write_done(key, e, None, err)
            raise err.with_key(key) from None
        e.writing = h
        h.add_done_callback(lambda hh, err: self._write_done(key, e, hh, err))
        if wait:
            self._settle(key)
        return h

    def _swap_out_streamed(self, key: str, tensor: torch.Tensor) -> CompletedWrite:
        """Device -> host copies of one piece overlap the writes of the pieces before it, and
        host memory stays at the ring's size whatever the tensor's (no whole pinned copy)."""
        nbytes = tensor.numel() * tensor.element_size()
        flat = tensor.view(-1).view(torch.uint8) if nbytes else None
        e = _Entry(self._new_path(key), tensor.shape, tensor.dtype, nbytes, 0)
        with self._lock:
            self._pending[key] = e
            self._disk_bytes += nbytes
        try:
            done = write_chunks(self.aio, e.path, nbytes, self._staging_ring(),
                                lambda pos, buf: buf.copy_(flat[pos:pos + buf.numel()]),
                                checksums=self.checksums, fsync=self.fsync)
        except BaseException as err:
            self._write_done(key, e, None, err)
            if isinstance(err, AioError):
                raise err.with_key(key) from None
            raise
        self._write_done(key, e, done, None)
        return done

    def _write_done(self, key: str, e: _Entry, h: IOHandle | CompletedWrite | None,
                    err: BaseException | None) -> None:
        with self._lock:
            if self._pending.get(key) is e:
                del self._pending[key]
            e.writing, e.staged = None, None
            if err is not None:
                self._drop_file(e)  # the previous version of the key, if any, stays
                return
            e.checksums = h.checksums
            old = self._entries.get(key)
            self._entries[key] = e
            if old is not None:
                self._discard(old)

    def _settle(self, key: str) -> None:
        """Waits for an in-flight write of key; a failure raises here with the key named."""
        with self._lock:
            e = self._pending.get(key)
        if e is not None and e.writing is not None:
            try:
                e.writing.wait()
            except AioError as err:
                raise err.with_key(key) from None

    # -- in ------------------------------------------------------------------------------------
    def prefetch(self, key: str) -> None:
        """Starts reading key into a host buffer (from the pool when one was given)."""
        self._settle(key)
        with self._lock:
            e = self._get(key)
            if e.prefetch is not None:
                return
            buf = self._host_buffer(e)
            h = self._read(key, e, buf)
            e.prefetch = (buf, h)

    def _host_buffer(self, e: _Entry) -> torch.Tensor:
        if self.pool is not None and e.nbytes <= self.pool.buffer_bytes:
            return self.pool.acquire(e.nbytes, residue=e.pad)
        return aligned_empty(e.nbytes, residue=e.pad, pin=pin_default())

    def _read(self, key: str, e: _Entry, buf: torch.Tensor) -> IOHandle:
        try:
            return self.aio.read(e.path, buf, offset=e.pad, expected_checksums=e.checksums)
        except AioError as err:
            raise err.with_key(key) from None

    def _typed(self, e: _Entry, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(e.dtype).view(e.shape) if e.nbytes else torch.empty(e.shape, dtype=e.dtype)

    def swap_in(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Returns the tensor stored under key (into `out` when given, on any device)."""
        self._settle(key)
        with self._lock:
            e = self._get(key)
            pf, e.prefetch = e.prefetch, None
        if out is not None and (out.dtype != e.dtype or out.numel() != e.shape.numel()):
            if pf is not None:
                self._release(pf)
            raise ValueError(f"swap_in({key!r}): out is {out.dtype}{tuple(out.shape)}, the "
                             f"stored tensor is {e.dtype}{tuple(e.shape)}")
        if pf is None and out is not None and out.device.type != "cpu" and out.is_contiguous():
            flat = out.view(-1)
            for start, chunk in self.stream_in(key):
                flat[start:start + chunk.numel()].copy_(chunk)
            return out
        read_into_out = False  # the bytes land in `out` itself: nothing to copy afterwards
        if pf is not None:
            buf, h = pf
        elif out is not None and out.device.type == "cpu" and out.is_contiguous():
            buf, h = out.view(-1).view(torch.uint8) if e.nbytes else out.view(-1), None
            read_into_out = True
            if e.nbytes:
                h = self._read(key, e, buf)
        else:
            buf = self._host_buffer(e)
            h = self._read(key, e, buf)
        try:
            if h is not None:
                h.wait()
        except AioError as err:
            self._release((buf, h))
            raise err.with_key(key) from None
        if out is None:
            if self.pool is not None and self.pool.owns(buf):
                result = self._typed(e, buf).clone()
                self.pool.release(buf)
                return result
            return self._typed(e, buf)
        if not read_into_out:
            out.copy_(self._typed(e, buf).view(out.shape))
            self._release((buf, h))
        return out

    def stream_in(self, key: str) -> Iterator[tuple[int, torch.Tensor]]:
        """Yields the tensor stored under key in pieces, in order: (first element, 1-D piece),
        each piece a view of a staging buffer that is reused once the next piece is asked for.
        Reads run ahead through the ring while a piece is consumed, so host memory stays at the
        ring's size whatever the tensor's: this is how swap_in fills a device tensor (NVMe ->
        host -> device, pipelined), and how an optimizer can walk a state larger than memory.
        The ring is the swapper's pool when its buffers hold an aio block, else
        stream.ring_pool's (queue_depth * thread_count blocks), made on first use."""
        self._settle(key)
        with self._lock:
            e = self._get(key)
        size = e.dtype.itemsize
        chunks = read_chunks(self.aio, e.path, e.nbytes, self._staging_ring(), offset=e.pad,
                             expected_checksums=e.checksums)
        try:
            for pos, buf in chunks:
                yield pos // size, buf.view(e.dtype)
        except AioError as err:
            raise err.with_key(key) from None
        finally:
            chunks.close()

    def _staging_ring(self) -> BufferPool:
        block = self.aio.config.block_size
        if self.pool is not None and self.pool.buffer_bytes >= block:
            return self.pool
        with self._lock:
            if self._ring is None:
                self._ring = ring_pool(self.aio.config)
            return self._ring

    def _release(self, pf: tuple[torch.Tensor, IOHandle | None]) -> None:
        buf, h = pf
        if h is not None and not h.done():
            try:
                h.wait()
            except AioError:
                pass
        if self.pool is not None and self.pool.owns(buf):
            self.pool.release(buf)

    def verify(self, key: str) -> None:
        """Reads key back and checks every block against its checksum; raises ChecksumError."""
        if not self.checksums:
            raise ValueError("verify() needs TensorSwapper(checksums=True)")
        self._settle(key)
        with self._lock:
            e = self._get(key)
        buf = self._host_buffer(e)
        try:
            h = self._read(key, e, buf)
            try:
                h.wait()
            except AioError as err:
                raise err.with_key(key) from None
        finally:
            if self.pool is not None and self.pool.owns(buf):
                self.pool.release(buf)

    # -- removal ---------------------------------------------------------------------------------
    def _discard(self, e: _Entry) -> None:
        if e.prefetch is not None:
            self._release(e.prefetch)
            e.prefetch = None
        self._drop_file(e)

    def remove(self, key: str) -> None:
        try:
            self._settle(key)
        except AioError:
            pass  # a failed write already left nothing behind
        with self._lock:
            e = self._entries.pop(key, None)
            if e is not None:
                self._discard(e)

    def synchronize(self) -> None:
        """Waits for all writes; raises the first failure after waiting for every key."""
        first = None
        for key in list(self._pending):
            try:
                self._settle(key)
            except AioError as err:
                first = first or err
        if first is not None:
            raise first

    def close(self) -> None:
        """Waits for outstanding I/O, then removes every file and the swapper's directory."""
        if self._closed:
            return
        self._closed = True
        try:
            self.synchronize()
        except AioError:
            pass  # closing discards everything anyway
        finally:
            with self._lock:
                for key in list(self._entries):
                    self._discard(self._entries.pop(key))
            self.aio.close()
            self._claim.release()

    def __enter__(self) -> "TensorSwapper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close()
