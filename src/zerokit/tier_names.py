"""The names of the tiers: one enum every module names a tier with.

A `TierName` is a `str` (`StrEnum`): it prints, formats and serialises as its value ("device",
"host", "nvme"), so the ledger's table, the start-up plan and the reports read as before, and it
compares equal to that string, so callers and tests that pass a plain name keep working. In code,
name a tier as `TierName.HOST`, never as the string: a typo is then an AttributeError at import
instead of a comparison that is silently False.
"""
from __future__ import annotations

import enum


class TierName(enum.StrEnum):
    DEVICE = "device"  # the compute device (on a CPU-only run, the CPU: see tiers/ledger.py)
    HOST = "host"      # host memory, page-locked where a buffer crosses to a CUDA device
    NVME = "nvme"      # files through the async I/O engine (tiers/nvme.py)
