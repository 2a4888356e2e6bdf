"""Element ranges a gradient has not received: what a held gradient (parts/held_gradient.py) and a
gradient file (parts/nvme.py) zero before a step reads them."""
from __future__ import annotations


def uncovered(lo: int, hi: int, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The sub-ranges of [lo, hi) outside every [a, b) in `covered` (in order; `covered` may
    overlap, be unsorted, or reach beyond [lo, hi))."""
    out, at = [], lo
    for a, b in sorted(covered):
        if a >= b:
            continue  # an empty range splits no gap
        if a > at:
            out.append((at, min(a, hi)))
        at = max(at, b)
        if at >= hi:
            break
    if at < hi:
        out.append((at, hi))
    return [(a, b) for a, b in out if a < b]
