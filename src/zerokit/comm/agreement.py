"""Rank agreement without a blocking read per unit: each collective carries what it is for.

[Note: rank agreement]
Ranks whose code took different paths (a data-dependent branch) would issue different
collectives: equal-sized ones pair silently wrong, unequal ones abort gloo or hang NCCL. Every
collective a unit issues therefore carries a *signature* (operation, unit index, bytes per rank),
and ranks compare signatures before the collective's result is used:

- gloo (`HeaderedExchanges`): a 3-integer header travels point-to-point (its own tag) to every
  peer when the collective is issued; the collective's own data is posted only once every peer's
  header has arrived and matched, so mismatched sizes never reach gloo (no abort), and a mismatch
  raises on every rank, naming both units. Headers are polled without blocking whenever a
  collective is issued or waited on; a wait blocks only on headers its data waits for anyway.
  Data is posted in issue order on every rank, so deferring never reorders collectives.
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


# ---- gloo: headers before data ------------------------------------------------------------------
@dataclass
class _Exchange:
    signature: Signature
    where: str
    post: Callable[[], object]                    # issues the collective's data; returns its work
    header_out: torch.Tensor
    header_in: dict[int, torch.Tensor]            # peer -> its header
    header_works: list = field(default_factory=list)
    work: object | None = None                    # the data's work, once posted


class HeaderedExchanges:
    """The gloo agreement: see [Note: rank agreement]."""

    def __init__(self, rank: int, peers: list[int],
                 on_mismatch: Callable[[Signature, str, Signature, int], None]):
        self.rank = rank
        self.peers = peers
        self._on_mismatch = on_mismatch
        self._queue: deque[_Exchange] = deque()   # issued, data not yet posted, in issue order

    def submit(self, sig: Signature, where: str, post: Callable[[], object]) -> _Exchange:
        out = torch.tensor(sig.values(), dtype=torch.int64)
        entry = _Exchange(sig, where, post, out, {p: torch.empty(3, dtype=torch.int64) for p in self.peers})
        for p in self.peers:
            entry.header_works.append(dist.isend(out, p, tag=HEADER_TAG))
            entry.header_works.append(dist.irecv(entry.header_in[p], p, tag=HEADER_TAG))
        self._queue.append(entry)
        self.poll()
        return entry

    def poll(self) -> None:
        """Post the data of the leading exchanges whose headers all arrived (never blocks)."""
        while self._queue and all(w.is_completed() for w in self._queue[0].header_works):
            self._post(self._queue.popleft())

    def settle(self, entry: _Exchange | None = None) -> None:
        """Post the data of every exchange up to `entry` (all, if None), waiting for headers."""
        while self._queue and (entry is None or entry.work is None):
            self._post(self._queue.popleft())

    def _post(self, entry: _Exchange) -> None:
        for w in entry.header_works:
            w.wait()
        for p in self.peers:
            theirs = Signature.of(entry.header_in[p].tolist())
            if theirs != entry.signature:
                self._on_mismatch(entry.signature, entry.where, theirs, p)
        entry.work = entry.post()

    def wait(self, entry: _Exchange) -> None:
        """The exchange's data has arrived (its headers were checked first)."""
        self.settle(entry)
        entry.work.wait()
