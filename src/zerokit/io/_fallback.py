"""Pure-Python I/O engine: the same interface as the native `_aio.Engine`, on threads.

Used where the native extension was not built (no compiler at install time). It is buffered
(no O_DIRECT: Python cannot cheaply stage unaligned memory) and checksums with zlib's CRC-32
rather than CRC-32C, so its checksums are labelled with their own algorithm name.
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

ERR_SHORT = -1
ERR_CHECKSUM = -2
BACKEND = "python-threads"
CHECKSUM_ALGORITHM = "crc32"


def _view(ptr: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")


class Activity:
    """The native engine's idle clock (csrc/aio/activity.h): seconds no read, no write, and
    nothing was in flight since construction, the interval open now included."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = [0, 0]
        now = time.perf_counter()
        self._since = [now, now, now]  # when each became idle (meaningful while it is)
        self._total = [0.0, 0.0, 0.0]

    def _idle(self, k: int) -> bool:
        return self._in_flight[k] == 0 if k < 2 else self._in_flight == [0, 0]

    def begin(self, write: bool) -> None:
        with self._lock:
            now, k = time.perf_counter(), int(write)
            for i in (k, 2):
                if self._idle(i):
                    self._total[i] += now - self._since[i]
            self._in_flight[k] += 1

    def end(self, write: bool) -> None:
        with self._lock:
            now, k = time.perf_counter(), int(write)
            self._in_flight[k] -= 1
            for i in (k, 2):
                if self._idle(i):
                    self._since[i] = now

    def idle_s(self) -> tuple[float, float, float]:
        with self._lock:
            now = time.perf_counter()
            return tuple(t + (now - s if self._idle(i) else 0.0)
                         for i, (t, s) in enumerate(zip(self._total, self._since)))


class Engine:
    def __init__(self, block_size: int, queue_depth: int, thread_count: int,
                 single_submit: bool, overlap_events: bool):
        if block_size <= 0 or block_size % 4096:
            raise ValueError(f"aio block_size must be a positive multiple of 4096, got {block_size}")
        self.block_size = block_size
        self.backend = BACKEND
        self.fallback_reason = ""
        self.kernel_blocks = 0
        self.pool_blocks = 0
        self.threads = queue_depth * thread_count
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="zk-aio")
        self._lock = threading.Lock()
        self._next = 1
        self._requests: dict[int, tuple[list[Future], int | None]] = {}
        self._activity = Activity()

    def idle_s(self) -> tuple[float, float, float]:
        return self._activity.idle_s()

    def num_blocks(self, nbytes: int, offset: int) -> int:
        if nbytes <= 0:
            return 0
        return (offset + nbytes - 1) // self.block_size - offset // self.block_size + 1

    def submit(self, write: bool, fd: int, direct: bool, ptr: int, nbytes: int, offset: int,
               fsync: bool = False, want_checksums: bool = False,
               expected: list[int] | None = None) -> int:
        n = self.num_blocks(nbytes, offset)
        if expected is not None and len(expected) != n:
            raise ValueError(f"aio: {len(expected)} expected checksums for {n} blocks")
        futures = []
        pos, end, i = offset, offset + nbytes, 0
        while pos < end:
            stop = min(end, (pos // self.block_size + 1) * self.block_size)
            exp = None if expected is None else expected[i]
            futures.append(self._pool.submit(self._block, write, fd, ptr + pos - offset,
                                             stop - pos, pos, want_checksums or exp is not None,
                                             exp))
            pos, i = stop, i + 1
        if futures:  # in flight until its last block ends
            self._activity.begin(write)
            left, lock = [len(futures)], threading.Lock()

            def block_done(_f):
                with lock:
                    left[0] -= 1
                    last = left[0] == 0
                if last:
                    self._activity.end(write)
            for f in futures:
                f.add_done_callback(block_done)
        with self._lock:
            self.pool_blocks += len(futures)
            rid = self._next
            self._next += 1
            self._requests[rid] = (futures, fd if fsync and write else None)
        return rid

    @staticmethod
    def _block(write, fd, ptr, length, off, want_crc, expected):
        """Returns (err, offset, got, bytes, crc)."""
        buf = _view(ptr, length)
        done = 0
        try:
            while done < length:
                if write:
                    r = os.pwrite(fd, buf[done:], off + done)
                    if r == 0:
                        return errno.ENOSPC, off, 0, 0, 0
                else:
                    r = os.preadv(fd, [buf[done:]], off + done)
                    if r == 0:
                        return ERR_SHORT, off, done, 0, 0
                done += r
        except InterruptedError:  # pragma: no cover - Python retries EINTR itself
            raise
        except OSError as e:
            return e.errno, off, 0, 0, 0
        crc = zlib.crc32(buf) if want_crc else 0
        if expected is not None and crc != expected:
            return ERR_CHECKSUM, off, crc, 0, crc
        return 0, off, 0, length, crc

    def done(self, request: int) -> bool:
        with self._lock:
            futures, _ = self._requests[request]
        return all(f.done() for f in futures)

    def wait(self, request: int):
        with self._lock:
            futures, sync_fd = self._requests.pop(request)
        results = [f.result() for f in futures]
        err, err_off, err_got, total = 0, -1, 0, 0
        for e, off, got, nbytes, _ in results:
            total += nbytes
            if e and (err == 0 or off < err_off):
                err, err_off, err_got = e, off, got
        if sync_fd is not None and err == 0:
            try:
                os.fdatasync(sync_fd)
            except OSError as e:
                err, err_off = e.errno, 0
        return err, err_off, err_got, total, [r[4] for r in results]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
