"""FileRange: elements of a file, the one value that names state resident on NVMe.

The nvme tier allocates them (tiers/nvme.py `NvmeTier.allocate`, re-exported there) and moves them
asynchronously (`NvmeTier.read` / `write`); optimizer parts, weight shards and TensorSwapper keys
hold them; the checkpoint package saves from and loads into them (checkpoint/interface.py) with
the synchronous `read()` / `write()` here, file to file where it can, since it has no tier.
`numel` is a field, as `nbytes` and `element_size` are properties: a FileRange is a value, not a
tensor, and code that takes either a tensor or a range says which it has (`segment_numel` in
checkpoint/interface.py).
"""
from __future__ import annotations

import dataclasses
import os

import torch


@dataclasses.dataclass(frozen=True)
class FileRange:
    """`numel` elements of `dtype` at byte `offset` of the file at `path`. `owner` names the nvme
    tier allocation the file belongs to ("" for a range named without a tier)."""

    path: str
    offset: int
    numel: int
    dtype: torch.dtype
    owner: str = dataclasses.field(default="", kw_only=True)

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size

    def narrow(self, start: int, length: int) -> "FileRange":
        """Elements [start, start + length) of this range."""
        if start < 0 or length < 0 or start + length > self.numel:
            raise ValueError(f"FileRange {self.path!r}: elements [{start}, {start + length}) "
                             f"outside [0, {self.numel})")
        return dataclasses.replace(self, offset=self.offset + start * self.element_size,
                                   numel=length)

    def read(self) -> torch.Tensor:
        """The elements, into a new CPU tensor, now (the tier's `read` is the asynchronous one)."""
        out = torch.empty(self.numel, dtype=self.dtype)
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        with open(self.path, "rb", buffering=0) as f:
            got = 0
            while got < len(view):
                n = os.preadv(f.fileno(), [view[got:]], self.offset + got)
                if n <= 0:
                    raise OSError(f"{self.path} is shorter than the range it holds: {self.nbytes} bytes "
                                  f"at {self.offset} wanted, read {got}")
                got += n
        return out

    def write(self, values: torch.Tensor) -> None:
        """Overwrite the elements with `values` (numel elements of any device, cast to dtype), now."""
        if values.numel() != self.numel:
            raise ValueError(f"FileRange {self.path}@{self.offset}: {values.numel()} values for a range of "
                             f"{self.numel} elements")
        data = values.detach().to("cpu", self.dtype).contiguous().view(-1).view(torch.uint8).numpy()
        view = memoryview(data).cast("B")
        fd = os.open(self.path, os.O_WRONLY)
        try:
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], self.offset + done)
        finally:
            os.close(fd)
