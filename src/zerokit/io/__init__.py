"""zerokit.io: the async NVMe tensor I/O engine (ZeRO-Infinity's offload path).

`AsyncIO` reads/writes tensors at file offsets and returns handles; `FileRange` names elements of
a file; `BufferPool` holds reusable O_DIRECT-aligned host buffers; `read_chunks` streams a file
range through a pool's buffers (NVMe -> host -> device). `TensorSwapper` (tensors by key) is
offered here too, its public name: it lives on the nvme tier (tiers/nvme_swapper.py), which is
built on this package, so it is imported on first use (PEP 562), never when `zerokit.io` is.
See docs/nvme.md.
"""
from zerokit.io.aio import AioConfig, AioError, AsyncIO, ChecksumError, IOHandle, native_available
from zerokit.io.buffers import ALIGN, SECTOR_ELEMENTS, BufferPool, aligned_empty, is_aligned
from zerokit.io.file_range import FileRange
from zerokit.io.stream import read_chunks

__all__ = ["ALIGN", "SECTOR_ELEMENTS", "AioConfig", "AioError", "AsyncIO", "BufferPool", "ChecksumError",
           "FileRange", "IOHandle", "TensorSwapper", "aligned_empty", "is_aligned",
           "native_available", "read_chunks"]


def __getattr__(name: str):
    if name == "TensorSwapper":
        from zerokit.tiers.nvme_swapper import TensorSwapper
        return TensorSwapper
    raise AttributeError(f"module 'zerokit.io' has no attribute {name!r}")
