"""The I/O engine backends the aio and swapper tests run on, each forced by name.

"linux-aio" and "psync-threads" are the native engine's two block backends; "python" is the
engine used where the extension was not built. A backend this machine cannot run is skipped with
the reason (test_aio_backends.py checks that "auto" picks linux-aio wherever the kernel grants it,
so a skip here never hides a broken kernel path).
"""
import ctypes
import platform
import warnings

import pytest

from zerokit.io import AsyncIO, native_available

# (io_setup, io_destroy) system call numbers, for probing the kernel without the extension.
_AIO_SYSCALLS = {"x86_64": (206, 207), "aarch64": (0, 1)}


def kernel_grants_aio() -> bool | None:
    """Whether the kernel gives this process an AIO context (None: unknown architecture)."""
    nr = _AIO_SYSCALLS.get(platform.machine())
    if nr is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ctx = ctypes.c_ulong(0)
    if libc.syscall(ctypes.c_long(nr[0]), ctypes.c_long(8), ctypes.byref(ctx)) != 0:
        return False
    libc.syscall(ctypes.c_long(nr[1]), ctx)
    return True


def _linux_aio_refusal() -> str | None:
    if not native_available():
        return "zerokit.io._aio not built (no C++ compiler at install)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            AsyncIO(backend="linux-aio").close()
    except RuntimeError as e:
        return str(e)
    return None


_NOT_BUILT = pytest.mark.skipif(not native_available(),
                                reason="zerokit.io._aio not built (no C++ compiler at install)")
_refusal = _linux_aio_refusal()
requires_linux_aio = pytest.mark.skipif(_refusal is not None, reason=str(_refusal))
BACKENDS = [
    pytest.param("linux-aio", marks=requires_linux_aio),
    pytest.param("psync-threads", marks=_NOT_BUILT),
    "python",
]
NATIVE_BACKENDS = BACKENDS[:2]
