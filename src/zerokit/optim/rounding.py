"""Narrowing fp32 to bf16 as the host kernels do: round to nearest even, or stochastically.

Stochastic rounding adds 16 random bits below the 16 kept ones and truncates, so x rounds up with
probability (x - lower) / (upper - lower): the expected bf16 value is x, and an update far below
half an ulp still moves the master on average. The random bits are a counter-based hash
(csrc/kernels/sr_hash.h, the same function bit for bit) of a key per buffer and step and of the
element's index, so every ISA, this torch code, any thread split and a run resumed from a
checkpoint (same seed, step and index_base) draw the same bits; no generator state exists.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_LOWBIAS_MUL = (0x7FEB352D, 0x846CA68B)
INDEX_MUL = 0x9E3779B9
_KEY_SALT = 0x5BD1E995
BUFFERS = ("master", "state0", "state1")  # the `buffer` argument of sr_key: 0, 1, 2


def _lowbias32_int(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * _LOWBIAS_MUL[0]) & _M32
    x ^= x >> 15
    x = (x * _LOWBIAS_MUL[1]) & _M32
    x ^= x >> 16
    return x


def sr_key(seed: int, step: int, buffer: int) -> int:
    """The key of one buffer (0 master, 1 state0, 2 state1) at one step (sr_hash.h, sr_key)."""
    seed &= (1 << 64) - 1
    step &= (1 << 64) - 1
    k = _lowbias32_int((seed & _M32) ^ _KEY_SALT)
    k = _lowbias32_int(k ^ (seed >> 32))
    k = _lowbias32_int(k ^ (step & _M32))
    k = _lowbias32_int(k ^ (step >> 32))
    return _lowbias32_int(k + buffer)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for int64 x in [0, 2**32), without overflowing int64: split c in halves.
    lo = (x * (c & 0xFFFF)) & _M32
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _LOWBIAS_MUL[0])
    x = x ^ (x >> 15)
    x = _mul32(x, _LOWBIAS_MUL[1])
    return x ^ (x >> 16)


def sr_bits(key: int, index0: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 random bits (int64, in [0, 65536)) of elements index0 .. index0 + n - 1, made on
    `device` (the device part of a unit steps there: optim/device_kernels.py)."""
    idx = torch.arange(index0, index0 + n, dtype=torch.int64, device=device) & _M32
    return _lowbias32(_mul32(idx, INDEX_MUL) ^ key) >> 16


def to_bf16(x: torch.Tensor, *, stochastic: bool = False, key: int = 0,
            index0: int = 0) -> torch.Tensor:
    """fp32 `x` (flat) narrowed to bf16: nearest even (torch's .to, as the kernels), or
    stochastically with the bits of elements index0.. under `key`. NaN becomes 0x7FC0."""
    if not stochastic:
        return x.to(torch.bfloat16)
    u = x.view(torch.int32).to(torch.int64) & _M32
    r = (u + sr_bits(key, index0, x.numel(), x.device)) >> 16
    r = torch.where(torch.isnan(x), torch.full_like(r, 0x7FC0), r)
    return torch.where(r >= 0x8000, r - 0x10000, r).to(torch.int16).view(torch.bfloat16)
