"""TensorSwapper: tensors out to files and back by key, on an nvme tier of its own.

A thin layer on `NvmeTier` (tiers/nvme.py), which owns everything about the files: the claimed
directory `<directory>/zerokit-swap/rank<r>-<pid>-<hex>/` ([Note: swap directory claims] in
io/swap_directory.py: two swappers, or a swapper and an engine, on one directory never touch each
other's files; what a dead run of this rank left there is removed at start, `stale_files`), the
space reserved at allocation, the asynchronous reads and writes (checksums, fsync, streaming
through a ring of pool buffers) and their stats, and the byte count (the tier's ledger:
`nvme_bytes`). The swapper keeps what a key adds: its shape and dtype, its checksums, and the
state of each version of it.

Each version of a key is one tier allocation (kind "buffers"), its bytes at offset `pad` =
the source tensor's address mod 4096 (see [Note: file residue] in io/aio.py), so memory and file
share a residue and O_DIRECT moves all but the edge sectors without staging. A version moves
through `SwapState` (states.py, by `states.move`; `where(key)` says the state's value):

    writing     swap_out submitted, not yet landed                -> nvme (or dropped: failed)
    nvme        on disk only                                      -> prefetching
    prefetching a read into a host buffer is in flight            -> prefetched, or nvme (taken)
    prefetched  on disk and in a host buffer (swap_in takes it)   -> nvme

A failed write frees its new version and keeps the key's previous one, if any; no other key is
touched. Every error is an AioError naming the path, the key and the offset.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Iterator

import torch

from zerokit.io.aio import AioConfig, AioError
from zerokit.io.buffers import ALIGN, BufferPool, aligned_empty, pin_default
from zerokit.io.file_range import FileRange
from zerokit.io.stream import CompletedWrite, ring_pool
from zerokit.states import SwapState, move
from zerokit.tiers.ledger import Ledger
from zerokit.tier_names import TierName
from zerokit.tiers.nvme import NvmeHandle, NvmeTier


@dataclasses.dataclass
class _Version:
    """One version of a key: its bytes in the tier's file (`file`: uint8 elements at `pad`)."""

    file: FileRange
    shape: torch.Size
    dtype: torch.dtype
    state: SwapState = SwapState.WRITING
    checksums: list[int] | None = None
    writing: NvmeHandle | None = None
    staged: torch.Tensor | None = None  # contiguous copy of a strided tensor, alive while written
    prefetch: tuple[torch.Tensor, NvmeHandle] | None = None

    @property
    def nbytes(self) -> int:
        return self.file.numel

    @property
    def pad(self) -> int:
        return self.file.offset

    def move(self, new: SwapState, key: str) -> None:
        self.state = move(self.state, new, f"swapped tensor {key!r}")


class TensorSwapper:
    def __init__(self, directory: str, *, rank: int = 0, config: AioConfig | None = None,
                 checksums: bool = False, fsync: bool = False, backend: str = "auto",
                 pool: BufferPool | None = None):
        self.tier = NvmeTier(Ledger(), directory, rank=rank, config=config, backend=backend)
        self.directory = self.tier.directory
        self.stale_files = self.tier.stale_files
        self.checksums = checksums
        self.fsync = fsync
        self.pool = pool
        self._ring: BufferPool | None = None  # staging for streamed reads, made on first use
        self._entries: dict[str, _Version] = {}
        self._pending: dict[str, _Version] = {}  # key -> the version being written
        self._seq = itertools.count()
        self._lock = threading.RLock()
        self._closed = False

    @property
    def aio(self):
        """The tier's I/O engine (`AsyncIO`)."""
        return self.tier.aio

    # -- bookkeeping -------------------------------------------------------------------------
    @property
    def nvme_bytes(self) -> int:
        """Bytes this swapper holds in files (in-flight writes included): its tier's ledger."""
        return self.tier.ledger.bytes(TierName.NVME)

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(set(self._entries) | set(self._pending))

    def where(self, key: str) -> str:
        """The key's state (see the module docstring): "writing", "nvme", "prefetching" or
        "prefetched"."""
        with self._lock:
            v = self._pending.get(key) or self._get(key)
            if v.state is SwapState.PREFETCHING and v.prefetch[1].done():
                v.move(SwapState.PREFETCHED, key)
            return v.state.value

    def residency(self) -> dict[str, str]:
        return {k: self.where(k) for k in self.keys()}

    def path_of(self, key: str) -> str:
        with self._lock:
            return (self._pending.get(key) or self._get(key)).file.path

    def _get(self, key: str) -> _Version:
        v = self._entries.get(key)
        if v is None:
            raise KeyError(f"no tensor swapped out under key {key!r} in {self.directory!r}")
        return v

    def _new_version(self, key: str, shape: torch.Size, dtype: torch.dtype, nbytes: int,
                     pad: int) -> _Version:
        """A tier allocation of pad + nbytes bytes, as the version being written of key (the
        sequence number first in the owner: a long key cut to the file-name limit stays unique)."""
        owner = f"{next(self._seq)}.{key}"
        try:
            whole = self.tier.allocate(owner, "buffers", pad + nbytes, torch.uint8)
        except AioError as err:
            raise err.with_key(key) from None
        v = _Version(whole.narrow(pad, nbytes), shape, dtype)
        self._pending[key] = v
        return v

    # -- out -----------------------------------------------------------------------------------
    def swap_out(self, key: str, tensor: torch.Tensor, *, wait: bool = False
                 ) -> NvmeHandle | CompletedWrite:
        """Starts writing the tensor under key; do not modify it until the handle is waited.
        A device tensor goes out through the staging ring and is written when this returns."""
        if self._closed:
            raise RuntimeError(f"TensorSwapper at {self.directory!r} is closed")
        self._settle(key)
        if tensor.device.type != "cpu":
            return self._swap_out_streamed(key, tensor.contiguous())
        src = tensor.contiguous()
        nbytes = src.numel() * src.element_size()
        with self._lock:
            v = self._new_version(key, src.shape, src.dtype, nbytes, src.data_ptr() % ALIGN)
            v.staged = src if src is not tensor else None
        data = src.view(-1).view(torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        try:
            h = self.tier.write(v.file, data, checksums=self.checksums, fsync=self.fsync)
        except AioError as err:
            self._write_done(key, v, None, err)
            raise err.with_key(key) from None
        # The callback before the handle is shared: a wait that completes the write runs it.
        h.add_done_callback(lambda hh, err: self._write_done(key, v, hh, err))
        v.writing = h
        if wait:
            self._settle(key)
        return h

    def _swap_out_streamed(self, key: str, tensor: torch.Tensor) -> CompletedWrite:
        """Device -> host copies of one piece overlap the writes of the pieces before it, and
        host memory stays at the ring's size whatever the tensor's (no whole pinned copy)."""
        nbytes = tensor.numel() * tensor.element_size()
        flat = tensor.view(-1).view(torch.uint8) if nbytes else None
        with self._lock:
            v = self._new_version(key, tensor.shape, tensor.dtype, nbytes, 0)
        try:
            done = self.tier.write_chunks(v.file, self._staging_ring(),
                                          lambda pos, buf: buf.copy_(flat[pos:pos + buf.numel()]),
                                          checksums=self.checksums, fsync=self.fsync)
        except BaseException as err:
            self._write_done(key, v, None, err)
            if isinstance(err, AioError):
                raise err.with_key(key) from None
            raise
        self._write_done(key, v, done, None)
        return done

    def _write_done(self, key: str, v: _Version, h: NvmeHandle | CompletedWrite | None,
                    err: BaseException | None) -> None:
        with self._lock:
            if self._pending.get(key) is v:
                del self._pending[key]
            v.writing, v.staged = None, None
            if err is not None:
                self.tier.free(v.file.owner)  # the previous version of the key, if any, stays
                return
            v.checksums = h.checksums
            v.move(SwapState.NVME, key)
            old = self._entries.get(key)
            self._entries[key] = v
            if old is not None:
                self._discard(old)

    def _settle(self, key: str) -> None:
        """Waits for an in-flight write of key; a failure raises here with the key named."""
        with self._lock:
            v = self._pending.get(key)
        if v is not None and v.writing is not None:
            try:
                v.writing.wait()
            except AioError as err:
                raise err.with_key(key) from None

    # -- in ------------------------------------------------------------------------------------
    def prefetch(self, key: str) -> None:
        """Starts reading key into a host buffer (from the pool when one was given)."""
        self._settle(key)
        with self._lock:
            v = self._get(key)
            if v.prefetch is not None:
                return
            buf = self._host_buffer(v)
            v.prefetch = (buf, self._read(key, v, buf))
            v.move(SwapState.PREFETCHING, key)

    def _host_buffer(self, v: _Version) -> torch.Tensor:
        if self.pool is not None and v.nbytes <= self.pool.buffer_bytes:
            return self.pool.acquire(v.nbytes, residue=v.pad)
        return aligned_empty(v.nbytes, residue=v.pad, pin=pin_default())

    def _read(self, key: str, v: _Version, buf: torch.Tensor) -> NvmeHandle:
        try:
            return self.tier.read(v.file, buf, expected_checksums=v.checksums)
        except AioError as err:
            raise err.with_key(key) from None

    def _typed(self, v: _Version, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(v.dtype).view(v.shape) if v.nbytes else torch.empty(v.shape, dtype=v.dtype)

    def swap_in(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Returns the tensor stored under key (into `out` when given, on any device)."""
        self._settle(key)
        with self._lock:
            v = self._get(key)
            pf, v.prefetch = v.prefetch, None
            if pf is not None:
                v.move(SwapState.NVME, key)
        if out is not None and (out.dtype != v.dtype or out.numel() != v.shape.numel()):
            if pf is not None:
                self._release(pf)
            raise ValueError(f"swap_in({key!r}): out is {out.dtype}{tuple(out.shape)}, the "
                             f"stored tensor is {v.dtype}{tuple(v.shape)}")
        if pf is None and out is not None and out.device.type != "cpu" and out.is_contiguous():
            flat = out.view(-1)
            for start, chunk in self.stream_in(key):
                flat[start:start + chunk.numel()].copy_(chunk)
            return out
        read_into_out = False  # the bytes land in `out` itself: nothing to copy afterwards
        if pf is not None:
            buf, h = pf
        elif out is not None and out.device.type == "cpu" and out.is_contiguous():
            buf, h = out.view(-1).view(torch.uint8) if v.nbytes else out.view(-1), None
            read_into_out = True
            if v.nbytes:
                h = self._read(key, v, buf)
        else:
            buf = self._host_buffer(v)
            h = self._read(key, v, buf)
        try:
            if h is not None:
                h.wait()
        except AioError as err:
            self._release((buf, h))
            raise err.with_key(key) from None
        if out is None:
            if self.pool is not None and self.pool.owns(buf):
                result = self._typed(v, buf).clone()
                self.pool.release(buf)
                return result
            return self._typed(v, buf)
        if not read_into_out:
            out.copy_(self._typed(v, buf).view(out.shape))
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
            v = self._get(key)
        size = v.dtype.itemsize
        chunks = self.tier.read_chunks(v.file, self._staging_ring(), expected_checksums=v.checksums)
        try:
            for pos, buf in chunks:
                yield pos // size, buf.view(v.dtype)
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

    def _release(self, pf: tuple[torch.Tensor, NvmeHandle | None]) -> None:
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
            v = self._get(key)
        buf = self._host_buffer(v)
        try:
            h = self._read(key, v, buf)
            try:
                h.wait()
            except AioError as err:
                raise err.with_key(key) from None
        finally:
            if self.pool is not None and self.pool.owns(buf):
                self.pool.release(buf)

    # -- removal ---------------------------------------------------------------------------------
    def _discard(self, v: _Version) -> None:
        """The version goes (no state move: it no longer exists) with its file."""
        if v.prefetch is not None:
            self._release(v.prefetch)
            v.prefetch = None
        self.tier.free(v.file.owner)

    def remove(self, key: str) -> None:
        try:
            self._settle(key)
        except AioError:
            pass  # a failed write already left nothing behind
        with self._lock:
            v = self._entries.pop(key, None)
            if v is not None:
                self._discard(v)

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
            self.tier.close()

    def __enter__(self) -> "TensorSwapper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close()
