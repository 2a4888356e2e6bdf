"""Built-in training text that needs no download: the Python standard library's own source.

Every machine with Python has it. Bytes are the tokens (vocab 256), so no tokenizer either.
"""
from __future__ import annotations

import os
import sysconfig

import torch


def stdlib_text(max_bytes: int = 8 << 20) -> bytes:
    """Concatenated .py files of the standard library, in a fixed order, up to max_bytes."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(chunks)[:max_bytes]
    if not chunks:
        raise RuntimeError(f"no Python source found under {root} to train on")
    return b"".join(chunks)


class ByteDataset(torch.utils.data.Dataset):
    """(input, target) windows of `block_size` bytes; the last 5% of the text is held out."""

    def __init__(self, text: bytes, block_size: int, split: str = "train"):
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        cut = int(len(data) * 0.95)
        self.data = data[:cut] if split == "train" else data[cut:]
        self.block_size = block_size
        if len(self.data) <= block_size + 1:
            raise ValueError(f"text of {len(self.data)} bytes is too short for block_size {block_size}")

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block_size: i * self.block_size + self.block_size + 1]
        return chunk[:-1], chunk[1:]
