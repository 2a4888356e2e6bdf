"""Byte counts as the reports print them (the ledger table, the start-up plan, `ratio: "auto"`'s
reason): one formatter, so the same bytes read the same everywhere."""
from __future__ import annotations


def mib(nbytes: float, decimals: int = 2, grouped: bool = True) -> str:
    """`nbytes` in MiB: '1,536.00 MiB'; `grouped=False` leaves out the thousands separator (the
    ledger's table columns)."""
    return f"{nbytes / 2**20:{',' if grouped else ''}.{decimals}f} MiB"
