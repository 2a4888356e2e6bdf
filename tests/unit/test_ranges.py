"""parts/ranges.py `uncovered`: the gaps a gradient zeroes, against an element-by-element count."""
import random

import pytest

from zerokit.parts.ranges import uncovered


def _reference(lo: int, hi: int, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Mark each element, then read the unmarked runs off."""
    hit = [any(a <= i < b for a, b in covered) for i in range(lo, hi)]
    out, start = [], None
    for i, h in zip(range(lo, hi), hit):
        if not h and start is None:
            start = i
        if h and start is not None:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, hi))
    return out


@pytest.mark.parametrize("lo,hi,covered", [
    (0, 10, []),
    (0, 10, [(0, 10)]),
    (0, 10, [(3, 5)]),
    (0, 10, [(5, 7), (0, 2)]),           # unsorted
    (0, 10, [(1, 6), (4, 8)]),           # overlapping
    (4, 12, [(0, 6), (10, 20)]),         # reaching beyond [lo, hi)
    (4, 12, [(12, 15), (0, 4)]),         # touching the ends only
    (0, 10, [(2, 2)]),                   # empty range
])
def test_uncovered_matches_an_element_count(lo, hi, covered):
    assert uncovered(lo, hi, covered) == _reference(lo, hi, covered)


def test_uncovered_random_ranges():
    rng = random.Random(7)
    for _ in range(300):
        lo = rng.randrange(0, 20)
        hi = lo + rng.randrange(0, 30)
        covered = []
        for _ in range(rng.randrange(0, 5)):
            a = rng.randrange(0, 55)
            covered.append((a, a + rng.randrange(0, 12)))
        assert uncovered(lo, hi, covered) == _reference(lo, hi, covered), (lo, hi, covered)
