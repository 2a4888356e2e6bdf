"""The rank-agreement bookkeeping, without a device: when a lagged (NCCL) check is verified, and
what a divergence says. Fake completions stand in for CUDA events."""
from __future__ import annotations

import pytest

from zerokit.comm.agreement import OPS, PendingChecks, Signature, describe_divergence


class FakeEvent:
    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def _queue(n: int, lag: int) -> tuple[PendingChecks, list[FakeEvent]]:
    events = [FakeEvent() for _ in range(n)]
    pending = PendingChecks(lag, lambda i: events[i])
    for i in range(n):
        pending.add(i)
    return pending, events


def test_nothing_due_while_results_travel_within_the_lag() -> None:
    pending, events = _queue(3, lag=4)
    assert pending.due() == [] and len(pending) == 3
    assert not any(e.waited for e in events)  # no blocking


def test_completed_checks_are_due_in_order_without_blocking() -> None:
    pending, events = _queue(4, lag=8)
    events[0].done = events[1].done = events[3].done = True  # 2 still travelling: 3 waits behind it
    assert pending.due() == [0, 1]
    assert not any(e.waited for e in events)
    events[2].done = True
    assert pending.due() == [2, 3]
    assert len(pending) == 0


def test_checks_older_than_the_lag_are_waited_for() -> None:
    pending, events = _queue(6, lag=2)
    assert pending.due() == [0, 1, 2, 3]  # 4 and 5 may stay in flight
    assert [e.waited for e in events] == [True, True, True, True, False, False]


def test_drain_waits_for_everything() -> None:
    pending, events = _queue(3, lag=8)
    events[1].done = True
    assert pending.drain() == [0, 1, 2]
    assert events[0].waited and events[2].waited and len(pending) == 0


def test_negative_lag_is_refused() -> None:
    with pytest.raises(ValueError, match="max_lag must be >= 0 .got -1"):
        PendingChecks(-1, lambda c: c)


def test_divergence_names_both_units_and_sizes() -> None:
    text = describe_divergence(1, 2, Signature(OPS["reduce_scatter"], 0, 400), "unit 'blocks.0'",
                               Signature(OPS["all_gather"], 2, 800), "rank 0",
                               ["blocks.0", "blocks.1", "root"])
    assert text.startswith("rank 1/2: ranks diverged"), text
    assert "reduce_scatter for unit 'blocks.0' (400 bytes)" in text, text
    assert "rank 0's all_gather for unit 'root' (800 bytes)" in text, text
    unknown = describe_divergence(0, 4, Signature(1, 5, 8), "unit 'x'", Signature(1, -1, 8),
                                  "another rank", [])
    assert "unit #-1" in unknown, unknown


@pytest.mark.parametrize("n,per", [(8, 8), (9, 4), (12, 4), (1000003, 262144)])
def test_gloo_pieces_are_all_full_size_and_cover_the_row(n: int, per: int) -> None:
    # Data is posted before the headers are compared, so a diverged peer's message may meet any
    # receive: every message of a row at least a piece long is exactly a piece (gloo aborts on a
    # message longer than its receive), and together they cover the row.
    from zerokit.comm.collectives import piece_starts

    starts = piece_starts(n, per)
    covered = set()
    for lo in starts:
        assert 0 <= lo and lo + per <= n
        covered.update(range(lo, lo + per)) if n < 10_000 else None
    assert starts[0] == 0 and starts[-1] == n - per
    assert all(b - a <= per for a, b in zip(starts, starts[1:]))  # no gap
    if n < 10_000:
        assert covered == set(range(n))
