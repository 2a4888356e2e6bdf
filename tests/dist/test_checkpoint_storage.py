"""Shard files: what save_shard_file writes (O_DIRECT, all tensors in flight at once) reads back.

Tensors of odd byte sizes put piece boundaries inside 4 KiB sectors; written as concurrent
O_DIRECT requests, two read-modify-writes of one sector lost one side (the header came back as
zeros) until shared sectors were assembled and written once. Checked with safetensors' reader
and with ShardFile.read_range, for whole tensors, tensors given as parts, and empty ones.
"""
from __future__ import annotations

import os
import random

import torch
from safetensors import safe_open

from zerokit.checkpoint.storage import ShardFile, save_shard_file

SIZES = [0, 1, 3, 100, 1023, 1024, 1025, 5000, 300_000, 1 << 20]
DTYPES = [torch.float32, torch.bfloat16, torch.uint8]


def _tensors(rng: random.Random) -> list[tuple[str, object, torch.Tensor]]:
    out = []
    for i in range(rng.randint(1, 12)):
        n = rng.choice(SIZES)
        t = (torch.randn(n) * 100).to(rng.choice(DTYPES))
        if n > 4 and rng.random() < 0.3:  # a 1-D tensor given as two consecutive parts
            k = rng.randint(1, n - 1)
            out.append((f"t{i}", [t[:k], t[k:]], t))
        else:
            out.append((f"t{i}", t, t))
    return out


def test_shard_files_read_back_exactly(tmp_path) -> None:
    rng = random.Random(0)
    for trial in range(30):
        tensors = _tensors(rng)
        path = str(tmp_path / f"{trial}.safetensors")
        size = save_shard_file(path, [(n, v) for n, v, _ in tensors], {"format": "pt"})
        assert os.path.getsize(path) == size
        with safe_open(path, "pt") as f:
            for name, _, want in tensors:
                assert torch.equal(f.get_tensor(name), want), (trial, name)
        shard = ShardFile(path)
        for name, _, want in tensors:
            if want.numel() > 2:
                lo, hi = 1, want.numel() - 1
                got = torch.empty(hi - lo, dtype=want.dtype)
                shard.read_range(name, lo, hi, got)
                assert torch.equal(got, want[lo:hi]), (trial, name)
        shard.close()
