"""Which cases of a parametrized grid run in the fast tier (`make test-fast`, `-m "not slow"`).

`make test` (CI) runs every case; the fast tier keeps a few cases of each area so a newcomer gets
a meaningful signal in minutes. A whole slow test takes `@pytest.mark.slow`; a grid keeps the cases
listed as fast and marks the rest:

    @pytest.mark.parametrize("stage,dtype", slow_except(GRID, fast=[(3, "bf16")]))
"""
from __future__ import annotations

from typing import Any, Iterable

import pytest


def slow_except(cases: Iterable[Any], fast: Iterable[Any]) -> list[Any]:
    """The cases, those not in `fast` marked slow. A tuple case is one value per argument name
    (wrap a single argument's tuple value in pytest.param first); order and ids are kept."""
    cases, keep = list(cases), list(fast)
    missing = [c for c in keep if c not in cases]
    if missing:
        raise ValueError(f"slow_except: fast cases {missing} are not in the grid {cases}")
    out = []
    for case in cases:
        if case in keep:
            out.append(case)
        elif isinstance(case, type(pytest.param(0))):  # already a pytest.param: add the mark
            out.append(pytest.param(*case.values, marks=[*case.marks, pytest.mark.slow], id=case.id))
        else:
            values = case if isinstance(case, tuple) else (case,)
            out.append(pytest.param(*values, marks=pytest.mark.slow))
    return out
