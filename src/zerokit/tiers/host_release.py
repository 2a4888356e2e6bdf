"""Giving the host memory that was freed back to the operating system.

Why: glibc's malloc serves a request below its mmap threshold from the heap, and raises that
threshold (up to 32 MiB) each time a larger mapped block is freed, so the tensors a model is built
and laid out with end up in the heap; once freed, the heap keeps their pages unless its top is
free. Measured at 1B parameters (benchmarks/bench_infinity.py, zk-inf-ds): after initialize the
heap held 2.5 GB of which 0.33 GB was in use, and RSS stayed 2.1 GiB above what the engine holds
for the whole run. `malloc_trim(0)` hands every free page of the heap back (madvise), leaving the
free lists as they were: later allocations reuse the addresses and fault in only what they touch.
Called where zerokit has just freed much (initialize: before the layout, after each unit that
retired zero.Init's gathered weights, and at its end; a checkpoint load; destroy); a no-op where
the C library has no malloc_trim (musl, macOS).
"""
from __future__ import annotations

import ctypes
import logging

import psutil

log = logging.getLogger("zerokit")

try:
    _trim = ctypes.CDLL(None).malloc_trim
    _trim.argtypes = [ctypes.c_size_t]
    _trim.restype = ctypes.c_int
except (OSError, AttributeError):
    _trim = None


def release_free_host_memory(why: str, quiet: bool = False) -> int:
    """Returns the heap's free pages to the kernel; the bytes RSS fell by (0 where unsupported).
    quiet: the caller logs the sum of many calls."""
    if _trim is None:
        return 0
    proc = psutil.Process()
    before = proc.memory_info().rss
    _trim(0)
    released = max(0, before - proc.memory_info().rss)
    if released >= 64 << 20 and not quiet:
        log.info("%s: returned %.0f MiB of freed host memory to the OS", why, released / 2**20)
    return released
