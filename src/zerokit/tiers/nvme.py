"""The NVMe tier: named file ranges in a per-rank swap directory, moved by zerokit.io.

[Note: the nvme tier]
The same three operations as DeviceTier / HostTier (tiers/tier.py), over files:
    allocate(owner, kind, numel, dtype) -> FileRange   a zero-filled file of numel elements,
                                                       held in the ledger's `nvme` tier
    free(owner)                                        the file is removed, the ledger released
    copy(dst, src) -> NvmeHandle                       one side a FileRange, the other a
                                                       contiguous CPU tensor: a read or a write
(`read(range, tensor)` and `write(range, tensor)` say the direction outright.) Every I/O is
asynchronous: the handle's `wait()` returns the bytes moved or raises `AioError` naming the file
and offset (a deleted file: "opening"; a truncated one: "short file"). A `FileRange` is a value
(io/file_range.py, the one class for elements of a file, re-exported here): `narrow(start,
length)` names a piece of it, so a streaming executor reads a sub-group at a time. Reads and writes
may carry per-block checksums and fsync (`AsyncIO`'s options); `read_chunks` / `write_chunks`
stream a range through a ring of pool buffers (io/stream.py), counted in `stats` as well.
TensorSwapper (tiers/nvme_swapper.py) keeps named tensors on a tier of its own this way.

One file per owner, starting at offset 0, so a host buffer from `io.buffers.aligned_empty` moves
by O_DIRECT without staging (see [Note: file residue] in io/aio.py). Files live in a directory of
the tier's own, `<nvme_path>/zerokit-swap/rank<r>-<pid>-<hex>/`, locked while the tier lives (see
[Note: swap directory claims] in io/swap_directory.py: a second engine or job on the same path
never touches this one's files); the 16-bit weight shards (kind "weights") in one under
offload_param's path where that names another than offload_optimizer's (another disk: both read
at once). What a dead run of this rank left there is removed when the tier starts, and said
(`stale_files`); `close()` removes the tier's directories.

`stats` counts the bytes read and written, the time callers were blocked in `wait()`, the
wall time from the first submission to the last completion, and the time the disk idled (no
read, no write, nothing of this tier's engine in flight: its own clock) since `stats.reset()`:
the per-step I/O report (engine.nvme_io(), memory_report(), the ledger) reads them.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from typing import Callable, Iterator

import torch

from zerokit.io.aio import AioConfig, AioError, AsyncIO, IOHandle
from zerokit.io.buffers import BufferPool
from zerokit.io.file_range import FileRange  # noqa: F401 (re-exported: the tier's allocations)
from zerokit.io.stream import CompletedWrite, read_chunks, write_chunks
from zerokit.io.swap_directory import SWAP_DIR, SwapDirectory  # noqa: F401 (SWAP_DIR: re-exported)
from zerokit.tiers.read_ahead import ReadAhead
from zerokit.tiers.ledger import Ledger
from zerokit.tier_names import TierName


class IOStats:
    """Bytes moved and time spent, since the last reset (thread-safe).

    With `idle_clock` (AsyncIO.idle_s: seconds no read / no write / nothing was in flight since
    the engine started) a snapshot also says how long the disk idled since the reset: `idle_s`
    (no request of either kind in flight), `read_idle_s` and `write_idle_s`, out of `window_s`
    (the wall time since the reset: with one take() per step, the step)."""

    def __init__(self, idle_clock: Callable[[], tuple[float, float, float]] | None = None) -> None:
        self._lock = threading.Lock()
        self._idle_clock = idle_clock
        self.total_read = self.total_written = 0  # since the tier opened (never reset)
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._reset()

    def _reset(self) -> None:
        self.bytes_read = 0
        self.bytes_written = 0
        self.wait_s = 0.0  # callers blocked in wait()
        self._first: float | None = None  # first submission
        self._last: float | None = None  # last completion
        self._start = time.perf_counter()
        self._idle0 = self._idle_clock() if self._idle_clock else None

    def take(self) -> dict[str, float]:
        """The snapshot, and a reset, at once (no submission falls between the two)."""
        with self._lock:
            out = self.snapshot()
            self._reset()
            return out

    def submitted(self, nbytes: int, write: bool) -> None:
        with self._lock:
            if write:
                self.bytes_written += nbytes
                self.total_written += nbytes
            else:
                self.bytes_read += nbytes
                self.total_read += nbytes
            if self._first is None:
                self._first = time.perf_counter()

    def completed(self, blocked_s: float) -> None:
        with self._lock:
            self.wait_s += blocked_s
            self._last = time.perf_counter()

    @property
    def io_s(self) -> float:
        """Wall time from the first submission to the last completion."""
        if self._first is None or self._last is None:
            return 0.0
        return max(self._last - self._first, 0.0)

    def snapshot(self) -> dict[str, float]:
        moved = self.bytes_read + self.bytes_written
        out = {"bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
               "io_s": self.io_s, "wait_s": self.wait_s,
               "gb_per_s": moved / self.io_s / 1e9 if self.io_s > 0 else 0.0,
               "window_s": time.perf_counter() - self._start}
        if self._idle0 is not None:
            now = self._idle_clock()
            out["read_idle_s"], out["write_idle_s"], out["idle_s"] = (
                max(0.0, b - a) for a, b in zip(self._idle0, now))
        return out


class NvmeHandle:
    """A read or write in flight; `wait()` returns the bytes moved (idempotent) or raises
    AioError naming the file."""

    def __init__(self, io: IOHandle, stats: IOStats):
        self._io, self._stats, self._done = io, stats, False

    def done(self) -> bool:
        return self._io.done()

    def wait(self) -> int:
        if self._done:
            return self._io.wait()
        start = time.perf_counter()
        try:
            return self._io.wait()
        finally:
            self._done = True
            self._stats.completed(time.perf_counter() - start)

    def synchronize(self) -> None:  # the CopyHandle spelling
        self.wait()

    @property
    def checksums(self) -> list[int] | None:
        """A write's per-block checksums (asked for with `checksums=True`), once waited."""
        return self._io.checksums

    def add_done_callback(self, fn: Callable[["NvmeHandle", AioError | None], None]) -> None:
        """fn(this handle, error_or_None) runs once, in the thread whose wait() completes the I/O."""
        self._io.add_done_callback(lambda _io, err: fn(self, err))


# Bytes of writes from given-back buffers (every unit's gradient pieces) in flight at once over
# a tier: enough to keep the disk busy, and the host memory they hold one constant.
WRITES_IN_FLIGHT_BYTES = 64 << 20


class _WindowWrite:
    """One write of a `WriteWindow`: ended once, then its buffer given back once."""

    def __init__(self, window: "WriteWindow", handle: NvmeHandle, nbytes: int,
                 give_back: Callable[[], None]):
        self.window, self.handle, self.nbytes, self._give_back = window, handle, nbytes, give_back
        self.open = True

    def wait(self) -> None:
        """Wait for the write (raising its error) and give its buffer back, whether it failed or
        not; again: only the wait again (idempotent, as a handle's)."""
        try:
            self.handle.wait()
        finally:
            if self.open:
                self.open = False
                self.window.closed(self)
                give_back, self._give_back = self._give_back, None
                give_back()


class WriteWindow:
    """Writes whose source buffers are given back once written, bounded over all of a tier's
    writers: past `limit` bytes in flight the oldest is waited for first. The host memory such
    writes hold is then one constant per tier, whatever the number of writers: bounded per
    writer (each unit's gradient file), a 1B model's backward held 20 units' windows, 1.25 GiB
    that no plan counted, and crossed its host budget."""

    def __init__(self, limit: int = WRITES_IN_FLIGHT_BYTES):
        self.limit = limit
        self._open: list[_WindowWrite] = []  # in submission order
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def bytes_in_flight(self) -> int:
        return self._bytes

    def add(self, handle: NvmeHandle, nbytes: int, give_back: Callable[[], None]) -> _WindowWrite:
        """Track a submitted write of `nbytes` (give_back runs once it has ended); waits for the
        oldest writes while more than `limit` bytes are in flight."""
        write = _WindowWrite(self, handle, nbytes, give_back)
        with self._lock:
            self._open.append(write)
            self._bytes += nbytes
        while True:
            with self._lock:
                if self._bytes <= self.limit or not self._open:
                    break
                oldest = self._open[0]
            oldest.wait()
        return write

    def closed(self, write: _WindowWrite) -> None:
        with self._lock:
            self._open.remove(write)
            self._bytes -= write.nbytes


class NvmeTier:
    """File ranges in a claimed directory under `directory`/zerokit-swap (weight shards under
    `weights_directory`'s where given), counted in the ledger's nvme tier."""

    name = TierName.NVME

    def __init__(self, ledger: Ledger, directory: str, *, rank: int = 0,
                 config: AioConfig | None = None, backend: str = "auto",
                 weights_directory: str | None = None):
        self.ledger = ledger
        self.root = os.path.abspath(os.fspath(directory))
        weights_root = os.path.abspath(os.fspath(weights_directory or directory))
        self._claims = [SwapDirectory(self.root, rank, error=AioError)]
        try:
            if os.path.realpath(weights_root) != os.path.realpath(self.root):
                self._claims.append(SwapDirectory(weights_root, rank, error=AioError))
            self.aio = AsyncIO(config, backend=backend)
        except BaseException:  # nothing may keep a claim (its lock) that no tier will release
            for claim in self._claims:
                claim.release()
            raise
        self.directory = self._claims[0].path
        self.weights_directory = self._claims[-1].path
        self.directories = [c.path for c in self._claims]
        self.stale_files = [f for c in self._claims for f in c.stale_files]
        self.stats = IOStats(self.aio.idle_s)
        # the gradient pieces' writes and, with accumulation, the reads of their earlier sums
        # (parts/nvme.py FileGradient); initialize sizes both (engine/byte_plan.py gradient_file_io)
        self.write_window = WriteWindow()
        self.read_ahead = ReadAhead(self)
        self._ranges: dict[str, FileRange] = {}
        self._lock = threading.Lock()  # allocate / free from several threads (a swapper's callbacks)
        self._closed = False

    def path_for(self, owner: str, kind: str | None = None) -> str:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", owner)[:120]
        directory = self.weights_directory if kind == "weights" else self.directory
        return os.path.join(directory, f"{safe}.swp")

    # ---- allocate / free ---------------------------------------------------------------------
    def allocate(self, owner: str, kind: str, numel: int, dtype: torch.dtype, *,
                 pinned: bool = False) -> FileRange:
        """A zero-filled file of `numel` elements, held in the ledger under `owner` until
        `free(owner)`. Its space is reserved now, so a full disk fails here, naming the file.
        `pinned` is accepted for the Tier signature and means nothing for a file."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"NvmeTier at {self.directory!r} is closed")
            if owner in self._ranges:
                raise ValueError(f"nvme tier: {owner!r} is allocated already ({self._ranges[owner].path})")
            rng = FileRange(self.path_for(owner, kind), 0, numel, dtype, owner=owner)
            _reserve(rng.path, rng.nbytes)
            self._ranges[owner] = rng
            self.ledger.hold_bytes(owner, kind, self.name, rng.nbytes)
            return rng

    def owners(self) -> list[str]:
        """The owners of the ranges allocated now."""
        with self._lock:
            return list(self._ranges)

    def free(self, owner: str) -> None:
        with self._lock:
            rng = self._ranges.pop(owner)
            _unlink(rng.path)
            self.ledger.release(owner)

    # ---- asynchronous copies -----------------------------------------------------------------
    def read(self, src: FileRange, dst: torch.Tensor, *,
             expected_checksums: list[int] | None = None) -> NvmeHandle:
        """dst <- the file range (same element count and dtype); dst must not be used until
        the handle is waited. expected_checksums: a write's, each block verified."""
        self._check(src, dst)
        self.stats.submitted(src.nbytes, write=False)
        return NvmeHandle(self.aio.read(src.path, dst, src.offset, expected_checksums=expected_checksums),
                          self.stats)

    def write(self, dst: FileRange, src: torch.Tensor, *, checksums: bool = False,
              fsync: bool = False) -> NvmeHandle:
        """The file range <- src; src must not be modified until the handle is waited. checksums:
        one per block, on the handle once waited; fsync: durable when the wait returns."""
        self._check(dst, src)
        self.stats.submitted(dst.nbytes, write=True)
        return NvmeHandle(self.aio.write(dst.path, src, dst.offset, fsync=fsync, checksums=checksums),
                          self.stats)

    def read_chunks(self, src: FileRange, ring: BufferPool, *,
                    expected_checksums: list[int] | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """The range's bytes through the ring's buffers, in order: (byte position, uint8 buffer),
        each buffer reused once the next is asked for (io/stream.py `read_chunks`)."""
        if self._closed:
            raise RuntimeError(f"NvmeTier at {self.directory!r} is closed")
        self.stats.submitted(src.nbytes, write=False)
        chunks = read_chunks(self.aio, src.path, src.nbytes, ring, offset=src.offset,
                             expected_checksums=expected_checksums)
        blocked = 0.0  # the caller's wait for each next chunk, not its time consuming one
        try:
            while True:
                start = time.perf_counter()
                try:
                    chunk = next(chunks)
                except StopIteration:
                    return
                finally:
                    blocked += time.perf_counter() - start
                yield chunk
        finally:
            chunks.close()
            self.stats.completed(blocked)

    def write_chunks(self, dst: FileRange, ring: BufferPool, fill: Callable[[int, torch.Tensor], None],
                     *, checksums: bool = False, fsync: bool = False) -> CompletedWrite:
        """The range <- bytes `fill(position, buffer)` puts into the ring's buffers, each written
        while the next is filled; returns once all are written (io/stream.py `write_chunks`)."""
        if self._closed:
            raise RuntimeError(f"NvmeTier at {self.directory!r} is closed")
        start = time.perf_counter()
        self.stats.submitted(dst.nbytes, write=True)
        try:
            return write_chunks(self.aio, dst.path, dst.nbytes, ring, fill, offset=dst.offset,
                                checksums=checksums, fsync=fsync)
        finally:
            self.stats.completed(time.perf_counter() - start)

    def copy(self, dst: "FileRange | torch.Tensor", src: "FileRange | torch.Tensor") -> NvmeHandle:
        """The Tier operation: a read when src is a FileRange, a write when dst is."""
        if isinstance(src, FileRange) and isinstance(dst, torch.Tensor):
            return self.read(src, dst)
        if isinstance(dst, FileRange) and isinstance(src, torch.Tensor):
            return self.write(dst, src)
        raise TypeError(f"nvme tier copy needs one FileRange and one tensor, got "
                        f"{type(dst).__name__} <- {type(src).__name__}")

    def _check(self, rng: FileRange, t: torch.Tensor) -> None:
        if self._closed:
            raise RuntimeError(f"NvmeTier at {self.directory!r} is closed")
        if t.dtype != rng.dtype or t.numel() != rng.numel:
            raise ValueError(f"nvme tier: {rng.path!r} holds {rng.numel} x {rng.dtype}, the "
                             f"tensor has {t.numel()} x {t.dtype}")

    # ---- end -----------------------------------------------------------------------------------
    def synchronize(self) -> None:
        self.aio.synchronize()

    def close(self) -> None:
        """Waits for I/O in flight, frees every range and removes this rank's directory; never
        raises for the I/O (see below)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.read_ahead.drop()
            self.aio.close()
        except AioError as e:
            # I/O into files about to be deleted: whatever failed is lost with them, and a step
            # that needed it has raised already (the engine is FAILED). Closing must finish.
            logging.getLogger("zerokit").warning("nvme: I/O still failing when the tier closed "
                                                 "(the swap files are removed): %s", e)
        finally:
            for owner in list(self._ranges):
                self.free(owner)
            for claim in self._claims:
                claim.release()


def _reserve(path: str, nbytes: int) -> None:
    """Create (or reset) the file with nbytes of zeros, the space reserved on the disk. A file
    that cannot be reserved (a full disk, EFBIG past RLIMIT_FSIZE) is removed again."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as e:
        raise AioError(e.errno, "creating", path) from None
    try:
        if nbytes:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    _unlink(path)
                    raise AioError(e.errno, f"reserving {nbytes} bytes for", path, offset=0) from None
                os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
