"""Asynchronous tensor reads and writes: one read/write pair returning handles.

`AsyncIO(config).write(path, tensor)` and `.read(path, tensor)` return an `IOHandle` at once; its
`wait()` returns the bytes moved or raises `AioError` naming the file, offset and errno text. The
native engine (`zerokit.io._aio`, built from csrc/aio) does O_DIRECT block-parallel I/O, through
Linux kernel AIO from one thread ("linux-aio") where the kernel grants an AIO context, else on a
pool of pread/pwrite threads ("psync-threads"); `AsyncIO.backend` says which, and the fallback is
said once with the kernel's reason. Where the extension was not built, a pure-Python thread engine
does buffered I/O with the same results (said once). Where a filesystem refuses O_DIRECT (tmpfs,
some network or FUSE filesystems), files are opened buffered, also said once.

[Note: file residue] O_DIRECT needs the memory address and the file offset aligned. The engine
stages only the blocks that are not, through per-thread bounce buffers; a tensor whose address
has the same residue modulo 4096 as its file offset therefore goes straight to disk except for
its partial first and last sectors. The swapper places each tensor at file offset
`data_ptr() % 4096` for that reason (ordinary torch tensors sit at 64 mod 4096).
"""
from __future__ import annotations

import dataclasses
import errno as errno_mod
import os
import threading
import warnings
from typing import Any, Callable

import torch

from zerokit.io import _fallback

try:
    from zerokit.io import _aio as _native
except ImportError:  # the extension is optional; see setup.py
    _native = None

_warned: set[str] = set()

BACKENDS = ("auto", "native", "linux-aio", "psync-threads", "python")


def native_available() -> bool:
    """Whether the native engine was built (else AsyncIO falls back to Python threads)."""
    return _native is not None


_warn_lock = threading.Lock()


def warn_once(tag: str, message: str) -> None:
    with _warn_lock:
        if tag in _warned:
            return
        _warned.add(tag)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AioConfig:
    """DeepSpeed's `aio` section, same keys and defaults, plus zerokit's `use_direct`."""

    block_size: int = 1 << 20
    """Bytes per I/O request; a multiple of 4096."""
    queue_depth: int = 8
    """Blocks in flight per submitting thread (DeepSpeed's meaning); the engine keeps
    queue_depth * thread_count in flight."""
    thread_count: int = 1
    """Submitting threads in DeepSpeed; here a multiplier of the depth: linux-aio keeps
    queue_depth * thread_count blocks on one kernel context, psync-threads runs that many
    threads."""
    single_submit: bool = False
    """Accepted for DeepSpeed compatibility; linux-aio submits whatever is ready in one call."""
    overlap_events: bool = True
    """Accepted for DeepSpeed compatibility; completions are always overlapped with submission."""
    use_direct: bool = True
    """Open files with O_DIRECT (bypassing the page cache) where the filesystem allows it."""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 4096:
            raise ValueError(f"aio.block_size must be a positive multiple of 4096, "
                             f"got {self.block_size}")
        if self.queue_depth < 1:
            raise ValueError(f"aio.queue_depth must be >= 1, got {self.queue_depth}")
        if self.thread_count < 1:
            raise ValueError(f"aio.thread_count must be >= 1, got {self.thread_count}")

    @classmethod
    def from_dict(cls, section: dict[str, Any] | None) -> "AioConfig":
        section = dict(section or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(section) - names)
        if unknown:
            raise ValueError(f"unknown aio keys {unknown}; valid keys are {sorted(names)}")
        return cls(**section)


class _LiveWrites:
    """Per file (st_dev, st_ino) with live writes (submitted, not yet completed) from any
    AsyncIO of this process: [size before the first of them, largest end any of them asked for,
    how many]. Cutting O_DIRECT's sector padding goes down to that end only, so one write's
    completion never truncates bytes another write of the same file put or is putting there,
    whichever engine submitted it. Every truncation happens under the lock."""

    def __init__(self) -> None:
        self.files: dict[tuple[int, int], list[int]] = {}
        self.lock = threading.Lock()

    def register(self, fd: int, end: int) -> tuple[tuple[int, int], int]:
        """Counts a write ending at `end` as live on fd's file; returns the file's key and size
        now. Under the lock, so no completion truncates between the stat and the count."""
        with self.lock:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            entry = self.files.get(key)
            if entry is None:
                self.files[key] = [st.st_size, end, 1]
            else:
                entry[1] = max(entry[1], end)
                entry[2] += 1
            return key, st.st_size

    def release(self, key: tuple[int, int]) -> None:
        with self.lock:
            entry = self.files[key]
            entry[2] -= 1
            if entry[2] == 0:
                del self.files[key]

    def cut_padding(self, fd: int, key: tuple[int, int]) -> None:
        """On a successful write's completion: direct writes round the last sector up, so cut
        the file back to the largest end the live writes of this file asked for (never below
        bytes another of them wrote or is writing, nor below what the file held before the first
        of them). The write is released afterwards."""
        with self.lock:
            size_before, end, _ = self.files[key]
            if size_before <= end < os.fstat(fd).st_size:
                os.ftruncate(fd, end)


_LIVE_WRITES = _LiveWrites()


class AioError(OSError):
    """An I/O failure, naming the file, the byte offset, the errno text and (from the swapper)
    the key of the tensor."""

    def __init__(self, err: int, what: str, path: str, *, offset: int | None = None,
                 key: str | None = None):
        self.path, self.offset, self.key, self.what = path, offset, key, what
        text = os.strerror(err) if err > 0 else "I/O error"
        where = f"{path!r}" + (f" at offset {offset}" if offset is not None else "")
        who = f" (key {key!r})" if key is not None else ""
        super().__init__(err if err > 0 else errno_mod.EIO, f"{what} {where}{who}: {text}")
        self.filename = path

    def with_key(self, key: str) -> "AioError":
        return type(self)(self.errno, self.what, self.path, offset=self.offset, key=key)


def wait_all(handles) -> None:
    """Waits for every handle, then raises the first failure: none is left in flight to fail
    again later, in whatever waits for the engine next."""
    first = None
    for h in handles:
        try:
            h.wait()
        except OSError as e:
            first = first or e
    if first is not None:
        raise first


class ChecksumError(AioError):
    """A block's content does not match the checksum recorded when it was written."""


class IOHandle:
    """One submitted read or write. `wait()` returns the bytes moved or raises AioError; it is
    idempotent. The handle keeps the tensor alive and closes its file when the I/O completes."""

    def __init__(self, aio: "AsyncIO", write: bool, path: str, fd: int, direct: bool,
                 tensor: torch.Tensor, offset: int, request: int, fsync: bool,
                 file_key: tuple[int, int] | None, checksums: bool,
                 expected: list[int] | None):
        self._aio, self.write, self.path, self._fd = aio, write, path, fd
        self.direct, self._tensor, self.offset, self._request = direct, tensor, offset, request
        # A write's file identity (st_dev, st_ino), registered in _LIVE_WRITES until done.
        self._fsync, self._file_key = fsync, file_key
        self._want_checksums, self._expected = checksums, expected
        self.nbytes = tensor.numel() * tensor.element_size()
        self.checksums: list[int] | None = None
        self._callbacks: list[Callable[["IOHandle", AioError | None], None]] = []
        self._lock = threading.Lock()
        self._result: int | AioError | None = None

    def done(self) -> bool:
        with self._lock:
            return self._result is not None or self._aio._engine.done(self._request)

    def add_done_callback(self, fn: Callable[["IOHandle", AioError | None], None]) -> None:
        """fn(handle, error_or_None) runs once, in the thread whose wait() completes the I/O."""
        self._callbacks.append(fn)

    def wait(self) -> int:
        with self._lock:
            if self._result is None:
                self._result = self._complete()
                callbacks, self._callbacks = self._callbacks, []
            else:
                callbacks = []
        err = self._result if isinstance(self._result, AioError) else None
        for fn in callbacks:
            fn(self, err)
        if err is not None:
            raise err
        return self._result

    def _complete(self) -> int | AioError:
        err, off, got, nbytes, crcs = self._aio._engine.wait(self._request)
        try:
            if err == errno_mod.EINVAL and self.direct:
                # The filesystem took O_DIRECT at open but refuses it per request: redo it
                # buffered. Same file, so the write stays registered in _LIVE_WRITES.
                warn_once(f"einval:{os.path.dirname(self.path)}",
                          f"O_DIRECT I/O refused (EINVAL) under {os.path.dirname(self.path)!r}; "
                          f"using buffered I/O there")
                fd, self._fd = self._fd, -1
                os.close(fd)
                self._fd = os.open(self.path, os.O_RDWR if self.write else os.O_RDONLY)
                self.direct = False
                self._request = self._aio._engine.submit(
                    self.write, self._fd, False, self._tensor.data_ptr(), self.nbytes,
                    self.offset, fsync=False, want_checksums=self._want_checksums,
                    expected=self._expected)
                err, off, got, nbytes, crcs = self._aio._engine.wait(self._request)
            if err == _fallback.ERR_SHORT:
                size = os.fstat(self._fd).st_size
                return AioError(errno_mod.EIO, f"short file ({size} bytes; block at {off} "
                                f"has {got} bytes) reading", self.path, offset=off)
            if err == _fallback.ERR_CHECKSUM:
                return ChecksumError(errno_mod.EIO, f"checksum mismatch (found {got:#010x}) "
                                     f"reading", self.path, offset=off)
            if err:
                return AioError(err, "writing" if self.write else "reading", self.path,
                                offset=off)
            if self.write:
                _LIVE_WRITES.cut_padding(self._fd, self._file_key)
                if self._fsync:
                    os.fsync(self._fd)
            self.checksums = list(crcs) if self._want_checksums else None
            return nbytes
        except OSError as e:
            return AioError(e.errno or errno_mod.EIO, "finishing", self.path)
        finally:
            if self._fd >= 0:
                os.close(self._fd)
            self._tensor = None
            self._aio._forget(self)

    def __del__(self):
        # The engine may still be writing into the tensor's memory: never let it be freed first.
        if getattr(self, "_result", 1) is None:
            try:
                self.wait()
            except Exception:
                pass


class AsyncIO:
    """Reads and writes whole tensors (any dtype, contiguous, on the CPU) at file offsets."""

    def __init__(self, config: AioConfig | None = None, *, backend: str = "auto"):
        """backend: "auto" (native if built, with linux-aio where the kernel allows it),
        "native" (the same, but the extension must be built), "linux-aio" or "psync-threads"
        (that native backend or an error) or "python". `self.backend` names the one in use."""
        self.config = config or AioConfig()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend not in ("auto", "python") and _native is None:
            raise RuntimeError("zerokit.io._aio is not built; reinstall with a C++ compiler "
                               "(pip install -e . --no-build-isolation) or use backend='python'")
        if backend == "auto" and _native is None:
            warn_once("no-native", "zerokit.io._aio (native async I/O) is not built; using "
                      "buffered Python threads, which are slower and skip O_DIRECT")
        use_native = _native is not None and backend != "python"
        c = self.config
        args = (c.block_size, c.queue_depth, c.thread_count, c.single_submit, c.overlap_events)
        if use_native:
            kind = backend if backend in ("linux-aio", "psync-threads") else "auto"
            try:
                self._engine = _native.Engine(*args, backend=kind)
            except RuntimeError as e:  # linux-aio asked for and refused by the kernel
                raise RuntimeError(f"aio backend 'linux-aio': {e}; use backend='auto' to fall "
                                   f"back to 'psync-threads'") from None
            if self._engine.fallback_reason:
                warn_once("no-kernel-aio", f"{self._engine.fallback_reason}; zerokit.io runs "
                          f"O_DIRECT blocks on pread/pwrite threads (psync-threads) instead")
        else:
            self._engine = _fallback.Engine(*args)
        # "linux-aio", "psync-threads" or "python-threads": what moves direct, aligned blocks.
        self.backend: str = self._engine.backend
        self.checksum_algorithm = "crc32c" if use_native else _fallback.CHECKSUM_ALGORITHM
        self._direct_ok = c.use_direct and use_native and hasattr(os, "O_DIRECT")
        self._live: set[IOHandle] = set()
        self._lock = threading.Lock()

    def block_counts(self) -> dict[str, int]:
        """Blocks submitted so far by path: "kernel" (linux-aio) and "threads" (pread/pwrite on
        the pool: buffered files, unaligned edges, or every block without linux-aio)."""
        return {"kernel": self._engine.kernel_blocks, "threads": self._engine.pool_blocks}

    def idle_s(self) -> tuple[float, float, float]:
        """Seconds since this engine started during which no read, no write, and nothing at all
        was in flight (submitted, not finished: the engine's own clock, not the callers' waits)."""
        return tuple(self._engine.idle_s())

    def num_blocks(self, nbytes: int, offset: int = 0) -> int:
        """How many checksums a request of nbytes at offset has (one per block)."""
        return self._engine.num_blocks(nbytes, offset)

    def _open(self, path: str, write: bool) -> tuple[int, bool]:
        flags = (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY
        if self._direct_ok:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o600), True
            except OSError as e:
                if e.errno != errno_mod.EINVAL:
                    raise AioError(e.errno, "opening", path) from None
                warn_once(f"odirect:{os.path.dirname(path)}",
                          f"O_DIRECT refused by the filesystem of {os.path.dirname(path)!r}; "
                          f"using buffered I/O there")
        try:
            return os.open(path, flags, 0o600), False
        except OSError as e:
            raise AioError(e.errno, "opening", path) from None

    def _submit(self, write: bool, path: str, tensor: torch.Tensor, offset: int, fsync: bool,
                checksums: bool, expected: list[int] | None) -> IOHandle:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"aio needs a contiguous CPU tensor, got device={tensor.device} "
                             f"contiguous={tensor.is_contiguous()} for {path!r}")
        path = os.fspath(path)
        fd, direct = self._open(path, write)
        nbytes = tensor.numel() * tensor.element_size()
        key = None
        try:
            if write:
                key, size_before = _LIVE_WRITES.register(fd, offset + nbytes)
            if write and nbytes and size_before < offset + nbytes:
                # Reserving the extent up front lets ext4/xfs run the direct block writes in
                # parallel instead of serialising each file-extending write, and turns a full
                # disk into one early ENOSPC.
                try:
                    os.posix_fallocate(fd, size_before, offset + nbytes - size_before)
                except OSError as e:
                    if e.errno not in (errno_mod.EOPNOTSUPP, errno_mod.EINVAL):
                        raise AioError(e.errno, "reserving space for writing", path,
                                       offset=size_before) from None
            req = self._engine.submit(write, fd, direct, tensor.data_ptr(), nbytes, offset,
                                      fsync=False, want_checksums=checksums, expected=expected)
        except BaseException:
            if key is not None:
                _LIVE_WRITES.release(key)
            os.close(fd)
            raise
        h = IOHandle(self, write, path, fd, direct, tensor, offset, req, fsync, key,
                     checksums or expected is not None, expected)
        with self._lock:
            self._live.add(h)
        return h

    def write(self, path: str, tensor: torch.Tensor, offset: int = 0, *, fsync: bool = False,
              checksums: bool = False) -> IOHandle:
        """Writes the tensor's bytes at offset; with fsync they are durable when wait() returns.
        Do not modify the tensor until then."""
        return self._submit(True, path, tensor, offset, fsync, checksums, None)

    def read(self, path: str, tensor: torch.Tensor, offset: int = 0, *,
             expected_checksums: list[int] | None = None, checksums: bool = False) -> IOHandle:
        """Fills the tensor from the file at offset; a file that ends early raises."""
        return self._submit(False, path, tensor, offset, False, checksums, expected_checksums)

    def _forget(self, h: IOHandle) -> None:
        with self._lock:
            self._live.discard(h)
            if h.write and h._file_key is not None:
                _LIVE_WRITES.release(h._file_key)
                h._file_key = None

    def synchronize(self) -> None:
        """Waits for every outstanding request; raises the first error after waiting for all."""
        with self._lock:
            live = list(self._live)
        wait_all(live)

    def close(self) -> None:
        try:
            self.synchronize()
        finally:
            if hasattr(self._engine, "close"):
                self._engine.close()

    def __enter__(self) -> "AsyncIO":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
