"""Scratch buffers: a step's transient host buffers, kept for reuse instead of freed.

[Note: scratch buffers]
A large host buffer allocated fresh is memory the kernel maps and zeroes page by page when it is
first written: on the 2-core test VM, copying 200 MB into fresh memory took 79 ms, into memory
written before 10 ms (transparent huge pages did not help). A ZeRO-Infinity step on a 1B model
allocated ~16 GB of such transients (each unit's reduction bucket, its reduced shard, the gradient
pieces on their way to files, the weight shards read from NVMe), and its backward spent ~5 of its
10 s in those first touches (issue #26, point 7). The transients of a step recur with the same
sizes every step, so they are taken from and given back to a cache keyed by their size:
- `take` returns a buffer (4096-aligned, as O_DIRECT wants) counted by the ledger as the transient
  it is (kind, tier) at its size rounded up to 4096 bytes (what it holds), and the function
  giving it back;
- a buffer given back is idle: counted against its tier's budget but allocated to no kind
  (`Ledger.count_cached`, as CUDA's reserved bytes beside its allocated ones), and handed to the
  next `take` of its size on that tier, or of a size up to SLACK smaller (an embedding unit and
  the blocks share); gradient pieces bound for files go through buffers of at most
  GRAD_CHUNK_BYTES (parts/nvme.py), so that the cache holds a few sizes, not one per piece;
- at the end of a step (`Ledger.end_step`) the idle buffers no `take` of that step asked for are
  freed, so the cache holds one step's working set and no more; idle bytes stay within
  `idle_limit`, which initialize sets to what every plan counts for these buffers through the
  whole step, under a memory budget too (engine/byte_plan.py `reduce_buffer_bytes`, the
  reductions in flight, and `gradient_write_bytes`, the tier's write window); a `take` that
  would cross the tier's budget frees the idle buffers first, and only then fails. (A 3B run
  under a host budget once crossed it with idle buffers: the gradient writes were bounded per
  file, so 20 units' windows were in flight, which no plan counted; they share the tier's
  window now, tiers/nvme.py WriteWindow.)
Host memory only (CPU tensors): a CUDA device has its allocator's own cache. Whoever gives a
buffer back must hold no view of it (the next `take` of that size writes into it), and the
function that gave it back holds none either: at 1B with accumulation 4, the gradient files'
write records kept their give-back functions from one micro-step's backward to the next, and
with them 1.1-2.6 GiB of buffers the cache had freed (over `idle_limit`) and the ledger no
longer counted: RSS crossed a host budget the ledger kept.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from typing import TYPE_CHECKING, Callable

import torch

from zerokit.io.buffers import ALIGN, aligned_empty
from zerokit.tier_names import TierName

if TYPE_CHECKING:
    from zerokit.tiers.ledger import Ledger


SLACK = 1.25  # an idle buffer serves a request this much smaller (see `_fitting`)


def _rounded(nbytes: int) -> int:
    return -(-max(nbytes, 1) // ALIGN) * ALIGN


class ScratchCache:
    """The ledger's cache of idle scratch buffers (see the Note)."""

    def __init__(self, ledger: "Ledger"):
        self._ledger = ledger
        self._idle: dict[tuple[str, int], list[torch.Tensor]] = defaultdict(list)  # (tier, bytes)
        self._asked: set[tuple[str, int]] = set()  # sizes a take asked for since the last end_step
        self._lock = threading.Lock()
        self._idle_total = 0  # bytes of every idle buffer (what `idle_bytes` reads)
        self.stats = {"taken": 0, "reused": 0}  # read by tests and benchmarks
        # most idle bytes kept (None: no limit); initialize sets what the plan counts for them
        self.idle_limit: int | None = None

    @property
    def idle_bytes(self) -> int:
        return self._idle_total

    def take(self, kind: str, numel: int, dtype: torch.dtype, tier: str | None = None
             ) -> tuple[torch.Tensor, Callable[[], None]]:
        """A host buffer of `numel` elements of `dtype` (contents undefined), counted as a
        transient of `kind` on `tier` (None: where the ledger counts host memory); call the
        returned function to give it back."""
        tier = self._ledger.cpu_tier() if tier is None else TierName(tier)
        nbytes = numel * dtype.itemsize
        key = (tier, _rounded(nbytes))
        what = lambda: f"a scratch {kind} buffer of {numel:,} elements"  # noqa: E731
        with self._lock:
            self.stats["taken"] += 1
            key = self._fitting(key)
            self._asked.add(key)
            idle = self._idle.get(key)
            raw = idle.pop() if idle else None
            if raw is not None:  # idle -> taken: the count moves, never grows
                self.stats["reused"] += 1
                self._idle_total -= key[1]
                self._ledger.count_cached(tier, -key[1])
                self._ledger.count(tier, kind, key[1], what)
        if raw is None:
            if self._ledger.budget(tier) is not None:
                try:
                    self._ledger.check_room(tier, kind, key[1], what)
                except MemoryError:
                    self.drop_idle()  # idle buffers go first; the count below raises if still over
            self._ledger.count(tier, kind, key[1], what)
            raw = aligned_empty(key[1])
        released = False

        def give_back() -> None:
            # Drops this function's own reference: whoever still holds the function (a write's
            # record until its range is next settled) must not keep a freed buffer alive.
            nonlocal released, raw
            if released:
                return
            released = True
            buffer, raw = raw, None
            with self._lock:
                self._ledger.count(tier, kind, -key[1])
                if self.idle_limit is not None and self._idle_total + key[1] > self.idle_limit:
                    return  # freed: more idle than the plan counts
                self._ledger.count_cached(tier, key[1])
                self._idle[key].append(buffer)
                self._idle_total += key[1]
        return raw[:nbytes].view(dtype), give_back

    def _fitting(self, key: tuple[str, int]) -> tuple[str, int]:
        """The size to take: the request's own if one is idle, else the smallest idle size up to
        SLACK larger (units of nearly one size, an embedding and the blocks, share buffers)."""
        if self._idle.get(key):
            return key
        near = [k for k, bufs in self._idle.items()
                if bufs and k[0] == key[0] and key[1] < k[1] <= key[1] * SLACK]
        return min(near, key=lambda k: k[1]) if near else key

    def end_step(self) -> None:
        """Free the idle buffers of sizes this step did not ask for."""
        with self._lock:
            for key in [k for k in self._idle if k not in self._asked]:
                freed = key[1] * len(self._idle.pop(key))
                self._ledger.count_cached(key[0], -freed)
                self._idle_total -= freed
            self._asked = set()

    def drop_idle(self) -> None:
        """Free every idle buffer (a budget is short, or the engine empties its caches)."""
        with self._lock:
            for key, bufs in self._idle.items():
                self._ledger.count_cached(key[0], -key[1] * len(bufs))
            self._idle.clear()
            self._idle_total = 0
