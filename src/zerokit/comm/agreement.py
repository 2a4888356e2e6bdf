"""Rank agreement without a blocking read per unit: each collective carries what it is for.

[Note: rank agreement]
Ranks whose code took different paths (a data-dependent branch) would issue different
collectives: equal-sized ones pair silently wrong, unequal ones abort gloo or hang NCCL. Every
collective a unit issues therefore carries a *signature* (operation, unit index, bytes per rank),
and ranks compare signatures before the collective's result is used:

- gloo (`HeaderedExchanges`): a 3-integer header travels point-to-point (its own tag) to every
  peer when the collective is issued, and the collective's data is posted at the same moment:
  no round trip stands between issuing and moving data. The peers' headers are compared when the
  collective is waited (before its result is used) and, for every collective issued so far,
  where the engine settles (the step): a mismatch raises on every rank, naming both units.
  Posting data before the check is safe on gloo because every data message is at most
  `PIECE_BYTES` and every receive has room for that many (collectives.py `_exchange_pieces`):
  gloo accepts a shorter message into a larger receive and aborts the process only on a longer
  one, so a diverged peer's data can land wrongly, which the check reports, but never aborts.
  gloo's own collectives (an all-reduce that carries a unit: stage 0) abort on any size
  mismatch, so their data is still posted only once the headers matched: when a later
  collective finds the headers arrived (their buffers start zeroed and a header's op is never
  0; gloo's `is_completed()` stays False until `wait()`), or at their wait.
  (Until issue #29 the data waited for the headers: gloo's `is_completed()` on a point-to-point
  work stays False until `wait()`, so the data of every exchange was posted at its wait, and no
  reduction or prefetch overlapped compute.)
- NCCL (`LaggedChecks`): reading a device value blocks the host, so the signature goes through a
  small asynchronous all-reduce (max and min of each field) ahead of the data, its result is
  copied to pinned host memory behind a CUDA event, and the result is verified once the event has
  completed (`event.query()`, no blocking) at a later collective; only checks more than
  `AGREEMENT_LAG` collectives old are waited for, and every pending check is settled where the
  engine synchronises anyway (the step, before gradients are applied). A divergence is named at
  most AGREEMENT_LAG collectives late, always before an optimizer step uses the results.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Generic, Protocol, Sequence, TypeVar

import torch
import torch.distributed as dist

OPS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3}
_OP_NAMES = {v: k for k, v in OPS.items()}
HEADER_TAG = 1          # point-to-point tag of the headers; the exchanges' data uses tag 0
AGREEMENT_LAG = 8       # NCCL: checks verified at most this many collectives behind


@dataclass(frozen=True)
class Signature:
    """What a collective is for: the same on every rank when the ranks agree."""

    op: int      # OPS value
    unit: int    # the unit's index in the engine's list; -1 where no unit is known
    nbytes: int  # bytes this rank contributes (a size mismatch is a divergence too)

    def values(self) -> list[int]:
        return [self.op, self.unit, self.nbytes]

    @classmethod
    def of(cls, values: Sequence[int]) -> "Signature":
        return cls(int(values[0]), int(values[1]), int(values[2]))


def describe_divergence(rank: int, world: int, mine: Signature, where: str, theirs: Signature,
                        who: str, unit_names: Sequence[str]) -> str:
    """The error text of a divergence: this rank's collective and unit, and the other rank's."""
    def unit(sig: Signature) -> str:
        return f"unit '{unit_names[sig.unit]}'" if 0 <= sig.unit < len(unit_names) else \
            f"unit #{sig.unit}"
    here = where if where.startswith("unit '") or mine.unit < 0 else unit(mine)  # keeps "bucket k"
    return (f"rank {rank}/{world}: ranks diverged: this rank's {_OP_NAMES.get(mine.op, mine.op)} "
            f"for {here} ({mine.nbytes} bytes) met {who}'s "
            f"{_OP_NAMES.get(theirs.op, theirs.op)} for {unit(theirs)} ({theirs.nbytes} bytes). "
            f"Every rank must run the same modules in the same order (data-dependent branches "
            f"must agree across ranks).")


# ---- NCCL: checks verified behind ----------------------------------------------------------------
class Completion(Protocol):
    def query(self) -> bool: ...          # done, without blocking
    def synchronize(self) -> None: ...    # block until done


C = TypeVar("C")


class PendingChecks(Generic[C]):
    """Checks whose results are still travelling, oldest first; which may be verified now.

    Pure bookkeeping (the completion objects are injected): a check is due once its completion
    reports done, or, blocking, once more than `max_lag` newer checks exist behind it.
    """

    def __init__(self, max_lag: int, completion_of: Callable[[C], Completion]):
        if max_lag < 0:
            raise ValueError(f"max_lag must be >= 0 (got {max_lag})")
        self.max_lag = max_lag
        self._completion_of = completion_of
        self._queue: deque[C] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, check: C) -> None:
        self._queue.append(check)

    def due(self) -> list[C]:
        """Pop the checks to verify now, oldest first: the leading completed ones, and (waiting
        for them) those more than max_lag checks old. Results complete in issue order."""
        out = []
        while self._queue:
            done = self._completion_of(self._queue[0])
            if len(self._queue) > self.max_lag:
                done.synchronize()
            elif not done.query():
                break
            out.append(self._queue.popleft())
        return out

    def drain(self) -> list[C]:
        """Pop every check, waiting for each (where the caller synchronises anyway)."""
        out = []
        while self._queue:
            check = self._queue.popleft()
            self._completion_of(check).synchronize()
            out.append(check)
        return out


class _Done:
    """The completion of a result that is already on the host (a CPU run of the NCCL logic)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@dataclass
class _Check:
    signature: Signature
    where: str
    result: torch.Tensor       # host: [max of each field, -min of each field]
    done: Completion


class LaggedChecks:
    """The NCCL agreement: see [Note: rank agreement]. Runs on CPU tensors too (tests)."""

    def __init__(self, device: torch.device, on_mismatch: Callable[[Signature, str, Signature], None],
                 max_lag: int = AGREEMENT_LAG):
        self.device = device
        self._on_mismatch = on_mismatch
        self.pending: PendingChecks[_Check] = PendingChecks(max_lag, lambda c: c.done)

    def launch(self, sig: Signature, where: str) -> None:
        """Issue the agreement all-reduce for `sig` ahead of its collective; verify what is due."""
        values = sig.values()
        host = torch.tensor(values + [-v for v in values], dtype=torch.int64)
        if self.device.type == "cuda":
            # Pinned + non_blocking both ways: no copy here waits for the device.
            host = host.pin_memory()
            dev = host.to(self.device, non_blocking=True)
            dist.all_reduce(dev, dist.ReduceOp.MAX, async_op=True).wait()  # orders the stream only
            result = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
            result.copy_(dev, non_blocking=True)
            done: Completion = torch.cuda.Event()
            done.record()
        else:
            dist.all_reduce(host, dist.ReduceOp.MAX)
            result, done = host, _Done()
        self.pending.add(_Check(sig, where, result, done))
        self.verify(self.pending.due())

    def settle(self) -> None:
        """Verify every pending check (blocking): call where the host waits for the device anyway."""
        self.verify(self.pending.drain())

    def verify(self, checks: list[_Check]) -> None:
        for c in checks:
            n = len(c.signature.values())
            hi, lo = c.result[:n].tolist(), [-v for v in c.result[n:].tolist()]
            if hi != lo:
                mine = c.signature.values()
                other = [h if h != m else l for h, l, m in zip(hi, lo, mine)]
                self._on_mismatch(c.signature, c.where, Signature.of(other))


# ---- gloo: headers beside data -----------------------------------------------------------------
@dataclass
class _Exchange:
    signature: Signature
    where: str
    header_in: dict[int, torch.Tensor]            # peer -> its header
    header_works: list = field(default_factory=list)
    post: Callable[[], object] | None = None     # data posted only once the headers matched
    work: object | None = None                    # the data's work
    checked: bool = False                         # the peers' headers were compared

    def headers_arrived(self) -> bool:
        """Every peer's header is here (a hint read without blocking: see the Note)."""
        return all(int(h[0]) != 0 for h in self.header_in.values())


class HeaderedExchanges:
    """The gloo agreement: see [Note: rank agreement]."""

    def __init__(self, rank: int, peers: list[int],
                 on_mismatch: Callable[[Signature, str, Signature, int], None]):
        self.rank = rank
        self.peers = peers
        self._on_mismatch = on_mismatch
        self._unchecked: deque[_Exchange] = deque()   # issued, headers not compared, in issue order

    def submit(self, sig: Signature, where: str, post: Callable[[], object],
               size_safe: bool = True) -> _Exchange:
        """Send this rank's header to every peer and post the peers' headers' receives; post
        the data now if `size_safe` (no size mismatch can abort it), else once headers matched."""
        out = torch.tensor(sig.values(), dtype=torch.int64)
        entry = _Exchange(sig, where, {p: torch.zeros(3, dtype=torch.int64) for p in self.peers})
        for p in self.peers:
            entry.header_works.append(dist.isend(out, p, tag=HEADER_TAG))
            entry.header_works.append(dist.irecv(entry.header_in[p], p, tag=HEADER_TAG))
        self.poll()
        self._unchecked.append(entry)
        if size_safe:
            entry.work = post()
        else:
            entry.post = post
            self.poll()
        return entry

    def poll(self) -> None:
        """Check the leading exchanges whose headers arrived (never blocks for long)."""
        while self._unchecked and self._unchecked[0].headers_arrived():
            self._check(self._unchecked.popleft())

    def settle(self, entry: _Exchange | None = None) -> None:
        """Compare the headers of every exchange up to `entry` (all, if None), in issue order,
        waiting for them: the headers of later exchanges pair with later ones."""
        while self._unchecked and (entry is None or not entry.checked):
            self._check(self._unchecked.popleft())

    def _check(self, entry: _Exchange) -> None:
        for w in entry.header_works:
            w.wait()
        entry.checked = True
        for p in self.peers:
            theirs = Signature.of(entry.header_in[p].tolist())
            if theirs != entry.signature:
                self._on_mismatch(entry.signature, entry.where, theirs, p)
        if entry.post is not None:
            entry.work = entry.post()

    def wait(self, entry: _Exchange) -> None:
        """The exchange's data has arrived, and its headers (checked first) agree."""
        self.settle(entry)
        entry.work.wait()
