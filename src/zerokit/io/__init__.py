"""zerokit.io: the async NVMe tensor I/O engine (ZeRO-Infinity's offload path).

`AsyncIO` reads/writes tensors at file offsets and returns handles; `TensorSwapper` keeps tensors
by key in a per-rank directory; `BufferPool` holds reusable O_DIRECT-aligned host buffers;
`read_chunks` streams a file range through a pool's buffers (NVMe -> host -> device).
See docs/nvme.md.
"""
from zerokit.io.aio import AioConfig, AioError, AsyncIO, ChecksumError, IOHandle, native_available
from zerokit.io.buffers import ALIGN, BufferPool, aligned_empty, is_aligned
from zerokit.io.stream import read_chunks
from zerokit.io.swapper import TensorSwapper

__all__ = ["ALIGN", "AioConfig", "AioError", "AsyncIO", "BufferPool", "ChecksumError",
           "IOHandle", "TensorSwapper", "aligned_empty", "is_aligned", "native_available",
           "read_chunks"]
