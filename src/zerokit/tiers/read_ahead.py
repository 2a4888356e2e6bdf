"""Reads of file ranges issued before they are asked for, in the order they were asked for last.

[Note: gradient read-ahead]
With gradient accumulation, each micro-step after the first reads every gradient file range that
the earlier micro-steps summed, adds the new piece and writes the sum back (parts/nvme.py
FileGradient). Read when its piece arrives, each range stalled backward: at 1B, accumulation 4,
backward took 21 s for 4 micro-steps (forward 4.6 s), with the disk idle 12.6 s of it (issue
#26). Backward reaches the units in the same order every micro-step, so the ranges are asked for
in the order they were last time. A `ReadAhead` logs the ranges asked for in one round (a round
ends when a range is asked for again: the next micro-step) and, as each is asked for, reads the
next ones of the last round into scratch buffers, up to `limit` bytes ahead: those reads run
while backward computes the units between.
- A range is read ahead only when its owner says it may be (`ready`: it holds an earlier
  micro-step's sum, and no write of it is in flight); a write to a range forgets what was read
  of it ahead (`forget`); what a round read ahead and did not ask for is dropped when the next
  round starts, so no read-ahead survives the data it read.
- `limit` 0 reads nothing ahead: each range is read when asked for.
- Thread-safe: backward asks from the main thread while a delayed update's stream, on its
  worker, zero-fills the other gradient file (`forget`).
- The buffers are the ledger's scratch buffers (kind "buffers", host tier): the plan counts
  `limit` for them (engine/byte_plan.py `gradient_file_io`); a read-ahead that would cross a
  budget is not issued (the range is then read when asked for).
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

from zerokit.io.file_range import FileRange
from zerokit.tier_names import TierName

Ready = Callable[[FileRange], bool]


class ReadAhead:
    """See [Note: gradient read-ahead]. `tier`: the nvme tier whose ranges these are."""

    def __init__(self, tier, limit: int = 0):
        self.tier, self.limit = tier, limit
        self._last: list[tuple[FileRange, Ready]] = []  # the last round's asks, in order
        self._position: dict[FileRange, int] = {}       # range -> its index in _last
        self._round: list[tuple[FileRange, Ready]] = []  # this round's asks so far
        self._asked: set[FileRange] = set()
        self._cursor = 0  # the next index of _last to consider reading ahead
        self._ahead: dict[FileRange, tuple[torch.Tensor, Callable[[], None], object]] = {}
        self.bytes_ahead = 0
        self.stats = {"ahead": 0, "now": 0}  # asks served by a read ahead / read when asked
        self._taken = dict(self.stats)  # stats at the last take (the step's report)
        self._lock = threading.RLock()

    def take(self) -> dict[str, int]:
        """The asks since the last take: served by a read ahead, and read when asked."""
        with self._lock:
            got = {k: v - self._taken[k] for k, v in self.stats.items()}
            self._taken = dict(self.stats)
        return got

    def read(self, rng: FileRange, ready: Ready) -> tuple[torch.Tensor, Callable[[], None]]:
        """rng's elements in a scratch buffer (the caller gives it back with the function
        returned), from a read ahead where there was one, else read now; then the ranges that
        followed rng last round are read ahead."""
        with self._lock:
            return self._read(rng, ready)

    def _read(self, rng: FileRange, ready: Ready) -> tuple[torch.Tensor, Callable[[], None]]:
        if rng in self._asked:
            self._next_round()
        self._round.append((rng, ready))
        self._asked.add(rng)
        entry = self._ahead.pop(rng, None)
        if entry is not None:
            self.bytes_ahead -= rng.nbytes
            buf, give_back, handle = entry
            self.stats["ahead"] += 1
        else:
            buf, give_back = self._take(rng)
            handle = self.tier.read(rng, buf)
            self.stats["now"] += 1
        try:
            handle.wait()
        except BaseException:
            give_back()
            raise
        position = self._position.get(rng)
        if position is not None:
            self._cursor = max(self._cursor, position + 1)
        self._fill()
        return buf, give_back

    def forget(self, rng: FileRange) -> None:
        """A write of rng is coming: what was read ahead of it is stale."""
        with self._lock:
            self._forget(rng)

    def _forget(self, rng: FileRange) -> None:
        for key in [k for k in self._ahead if k.path == rng.path and k.offset < rng.offset + rng.nbytes
                    and rng.offset < k.offset + k.nbytes]:
            self._drop(key)

    def drop(self) -> None:
        """Everything read ahead is given back (the tier closes, or a new round starts)."""
        with self._lock:
            for key in list(self._ahead):
                self._drop(key)

    # ---- internals ---------------------------------------------------------------------------
    def _take(self, rng: FileRange) -> tuple[torch.Tensor, Callable[[], None]]:
        # host buffers, as the pieces' write buffers (parts/nvme.py) and as the plan counts both
        # (engine/byte_plan.py `gradient_write_bytes`): on a CPU-only run "device" would escape
        # the host budget's check and keep them apart from the write buffers in the cache
        return self.tier.ledger.scratch.take("buffers", rng.numel, rng.dtype, TierName.HOST)

    def _next_round(self) -> None:
        self.drop()
        self._last, self._round, self._asked = self._round, [], set()
        self._position = {rng: i for i, (rng, _) in enumerate(self._last)}
        self._cursor = 0

    def _fill(self) -> None:
        while self._cursor < len(self._last):
            rng, ready = self._last[self._cursor]
            if rng in self._ahead or rng in self._asked:
                self._cursor += 1
                continue
            if self.bytes_ahead + rng.nbytes > self.limit:
                return
            self._cursor += 1
            if not ready(rng):
                continue
            try:
                buf, give_back = self._take(rng)
            except MemoryError:  # a budget is short: read it when asked for instead
                return
            try:
                handle = self.tier.read(rng, buf)
            except BaseException:
                give_back()
                raise
            self._ahead[rng] = (buf, give_back, handle)
            self.bytes_ahead += rng.nbytes

    def _drop(self, key: FileRange) -> None:
        buf, give_back, handle = self._ahead.pop(key)
        self.bytes_ahead -= key.nbytes
        try:
            handle.wait()  # the engine may still write into the buffer
        except Exception:
            pass  # a read no one asked for: its failure is the next read's to report
        finally:
            give_back()
