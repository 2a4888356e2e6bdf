"""Process-group set-up and the collectives the units issue, with timeouts and error text.

Every collective goes through `Comm`, which
- works at world size 1 without a launcher or a process group (every call is then a no-op);
- chooses the implementation per backend: on gloo, reduce-scatter and all-gather are direct
  point-to-point exchanges (each rank sends every peer the slice that peer needs), which move
  half the bytes of an all-reduce and beat gloo's own collectives (measured here, 12.8 MB fp32
  across 2 ranks: isend/irecv 6.0 ms, all_reduce 13.2 ms, all_gather_into_tensor 14.0 ms;
  gloo has no reduce_scatter_tensor fast path either); on NCCL the native collectives are used;
- turns a failure (a dead peer, a timeout) into a `CollectiveError` that says which collective,
  for which unit, and which rank stopped heart-beating, instead of a bare backend error or a hang;
- checks that every rank issues the same collective for the same unit, without a blocking read
  or a round trip per collective (see [Note: rank agreement] in comm/agreement.py).
"""
from __future__ import annotations

import atexit
import datetime
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from zerokit.comm.agreement import (OPS, HeaderedExchanges, LaggedChecks, Signature,
                                    describe_divergence)
from zerokit.comm.devices import ExistingGroup, choose_device, launched

HEARTBEAT_S = 1.0


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the rank, the call and the unit."""


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _current_cuda_index() -> int:
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def _existing_group() -> ExistingGroup | None:
    if not dist.is_available() or not dist.is_initialized():
        return None
    bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    return ExistingGroup(dist.get_backend(), bound.index if bound is not None else None)


# Heartbeat threads still beating, and whether zerokit created the process group: both are ended
# by _at_exit, before the interpreter finalizes (see there).
_BEATS: "set[tuple[threading.Event, threading.Thread]]" = set()
_CREATED_GROUP = False


@atexit.register
def _at_exit() -> None:
    """Interpreter finalization ends a daemon thread that is inside a native call (a heartbeat's
    store.set) by unwinding it through C++ frames, which aborts the process ('terminate called
    without an active exception', exit -6 instead of the code the program chose); a process group
    still alive then makes gloo abort the same way. So: stop and join the beats, then destroy the
    group zerokit created (a user's group is the user's to destroy)."""
    for stop, thread in list(_BEATS):
        stop.set()
        thread.join(timeout=10)
    if _CREATED_GROUP and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def require_backed(t: torch.Tensor, op: str, where: str) -> torch.Tensor:
    """`t`, after checking its storage still holds every byte it views. A buffer resized to zero
    (a released gather, a retired zero.Init unit) keeps its shape: handed to a collective it is
    sent from freed memory, which gloo reports as "writev: Bad address", or which sends whatever
    lies there now. Checked when a collective is posted, so a deferred one is checked too."""
    need = (t.storage_offset() + (t.numel() and 1 + sum((n - 1) * st for n, st in
                                                       zip(t.shape, t.stride())))) * t.element_size()
    have = t.untyped_storage().nbytes()
    if t.numel() and have < need:
        raise CollectiveError(f"{op} for {where}: its buffer's storage holds {have} bytes but the "
                              f"tensor ({tuple(t.shape)}, {t.dtype}) views {need}: the memory was "
                              f"freed (storage resized to zero) before the collective used it")
    return t


@dataclass
class Handle:
    """An in-flight collective. `wait()` runs the completion (copy-out) once, after the backend's."""

    work: object | None
    finish: Callable[[], None] | None
    describe: Callable[[BaseException], CollectiveError]
    done: bool = False
    parts: list["Handle"] = field(default_factory=list)  # a joined handle's collectives

    @classmethod
    def joined(cls, handles: list["Handle"], after: Callable[[], None]) -> "Handle":
        """One handle for several collectives, with a completion step after all of them."""
        def finish() -> None:
            for h in handles:
                h.wait()
            after()
        return cls(None, finish, handles[0].describe, parts=handles)

    def ready(self) -> bool:
        """wait() would not block: no backend work left (world 1's collectives, a joined handle
        whose collectives all are). A gloo exchange's headers and data are waited, never polled,
        so a handle with backend work is not ready until waited."""
        return self.done or (self.work is None and all(h.ready() for h in self.parts))

    def wait(self) -> None:
        if self.done:
            return
        try:
            if self.work is not None:
                self.work.wait()
        except CollectiveError:
            raise  # already says what went wrong (ranks diverged)
        except Exception as e:  # backend errors are RuntimeError / DistBackendError subclasses
            raise self.describe(e) from e
        if self.finish is not None:
            self.finish()
        self.done = True


@dataclass
class Comm:
    rank: int = 0
    world_size: int = 1
    backend: str = "none"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout_s: float = 1800.0
    _store: object | None = None
    _beat_stop: threading.Event = field(default_factory=threading.Event)
    unit_names: list[str] = field(default_factory=list)  # by unit index, for divergence errors
    unit_params: list[list[str]] = field(default_factory=list)  # by unit index: parameter names
    position: Callable[[], str] | None = None  # where this rank is in its schedule (the engine's)
    agreement: HeaderedExchanges | LaggedChecks | None = None  # see [Note: rank agreement]

    # ---- set-up -------------------------------------------------------------------------------
    @classmethod
    def from_environment(cls, timeout_s: float, model_device: torch.device | None = None) -> "Comm":
        """Join the process group torchrun describes (or reuse one), or run alone; on the device
        `devices.choose_device` picks, made current before the group or any tensor exists."""
        group = _existing_group()
        env = os.environ if dist.is_available() else {}
        device = choose_device(env, _cuda_count(), model_device, group, _current_cuda_index)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if group is None:
            if not launched(env):
                return cls(timeout_s=timeout_s, device=device)  # world size 1 without a launcher
            backend = "nccl" if device.type == "cuda" else "gloo"
            kwargs = {"device_id": device} if backend == "nccl" else {}
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
            global _CREATED_GROUP
            _CREATED_GROUP = True  # destroyed at exit: see _at_exit
        comm = cls(dist.get_rank(), dist.get_world_size(), dist.get_backend(), device, timeout_s)
        comm._start_heartbeat()
        comm._start_agreement()
        return comm

    def _start_agreement(self, kind: str | None = None) -> None:
        """kind: "headers" (gloo's default) or "lagged" (NCCL's; tests run it on gloo too)."""
        if self.world_size == 1:
            return
        kind = kind or ("headers" if self.backend == "gloo" else "lagged")
        if kind == "headers":
            self.agreement = HeaderedExchanges(self.rank, self._peers(), self._diverged)
        else:
            self.agreement = LaggedChecks(self.device, lambda mine, where, theirs:
                                          self._diverged(mine, where, theirs, None))

    def _diverged(self, mine: Signature, where: str, theirs: Signature, peer: int | None) -> None:
        who = f"rank {peer}" if peer is not None else "another rank"
        text = describe_divergence(self.rank, self.world_size, mine, where, theirs, who,
                                   self.unit_names)
        raise CollectiveError(text + self._context(mine.unit, theirs.unit))

    def _context(self, *units: int) -> str:
        """What a failure needs besides the collective: the units' parameters and this rank's
        position in its schedule (each rank reports its own; together they show where each was)."""
        parts = []
        for u in dict.fromkeys(units):
            if 0 <= u < len(self.unit_params) and u < len(self.unit_names):
                names = self.unit_params[u]
                more = f" and {len(names) - 6} more" if len(names) > 6 else ""
                parts.append(f"unit '{self.unit_names[u]}' holds {', '.join(names[:6])}{more}")
        if self.position is not None:
            try:
                parts.append(f"this rank was at {self.position()}")
            except Exception:  # the description must never hide the failure it describes
                pass
        return "".join(f" {p}." for p in parts)

    def settle_agreement(self) -> None:
        """Verify every collective issued so far agrees across ranks (blocking): the engine calls
        it where it synchronises anyway, before a step applies what the collectives produced."""
        if self.agreement is not None:
            self._guarded("rank agreement", "the collectives issued so far", self.agreement.settle)

    def _start_heartbeat(self) -> None:
        """Each rank stamps the store every second, so a failure can name the rank that died."""
        if self.world_size == 1:
            return
        try:
            self._store = dist.distributed_c10d._get_default_store()
        except Exception:
            return
        key = f"zerokit/heartbeat/{self.rank}"
        store, stop = self._store, self._beat_stop

        # The thread holds the store and the stop event, not the Comm: a Comm nobody closed (an
        # engine dropped without destroy(), zero.Init's) is still collected, and stops its beat.
        def beat() -> None:
            try:
                while not stop.wait(HEARTBEAT_S):
                    store.set(key, repr(time.time()))
            except Exception:
                pass
            finally:
                _BEATS.discard(entry)

        store.set(key, repr(time.time()))
        weakref.finalize(self, stop.set)
        thread = threading.Thread(target=beat, name="zerokit-heartbeat", daemon=True)
        entry = (stop, thread)
        _BEATS.add(entry)
        thread.start()

    def close(self) -> None:
        self._beat_stop.set()

    def silent_ranks(self) -> list[int]:
        """Ranks whose heartbeat did not advance over 3 beats (dead or stuck), per the store."""
        if self._store is None:
            return []

        def stamps() -> dict[int, str | None]:
            seen = {}
            for r in range(self.world_size):
                if r != self.rank:
                    try:
                        self._store.set_timeout(datetime.timedelta(seconds=2))
                        seen[r] = self._store.get(f"zerokit/heartbeat/{r}")
                    except Exception:
                        seen[r] = None
            return seen
        before = stamps()
        time.sleep(3 * HEARTBEAT_S)
        after = stamps()
        return [r for r in before if after[r] is None or after[r] == before[r]]

    # ---- errors -------------------------------------------------------------------------------
    def _describer(self, op: str, where: str) -> Callable[[BaseException], CollectiveError]:
        def describe(e: BaseException) -> CollectiveError:
            silent = self.silent_ranks()
            who = (f"rank(s) {silent} stopped responding (dead or stuck)" if silent
                   else "no peer looks dead: ranks may have taken different code paths")
            return CollectiveError(
                f"rank {self.rank}/{self.world_size}: {op} for {where} failed after at most "
                f"{self.timeout_s:.0f}s (comm_timeout_s): {who}. Backend said: "
                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}" + self._context())
        return describe

    def _guarded(self, op: str, where: str, call: Callable[[], object]) -> object:
        try:
            return call()
        except CollectiveError:
            raise
        except Exception as e:
            raise self._describer(op, where)(e) from e

    def _run(self, op: str, where: str, call: Callable[[], object | None],
             finish: Callable[[], None] | None, async_op: bool) -> Handle:
        """Issue a collective no signature travels with, after every gloo collective still
        waiting for its headers was posted (gloo pairs collectives in issue order)."""
        if isinstance(self.agreement, HeaderedExchanges):
            self._guarded(op, where, self.agreement.settle)
        return self._launch(op, where, call, finish, async_op)

    def _launch(self, op: str, where: str, call: Callable[[], object | None],
                finish: Callable[[], None] | None, async_op: bool) -> Handle:
        describe = self._describer(op, where)
        work = self._guarded(op, where, call)
        handle = Handle(work, finish, describe)
        if not async_op:
            handle.wait()
        return handle

    def _agreed(self, op: str, where: str, unit: int, nbytes: int, call: Callable[[], object | None],
                finish: Callable[[], None] | None, async_op: bool, size_safe: bool = True) -> Handle:
        """Issue a collective whose signature (op, unit, bytes) every rank checks: see
        [Note: rank agreement]. gloo compares the peers' headers when the data is waited."""
        sig = Signature(OPS[op], unit, nbytes)
        if isinstance(self.agreement, HeaderedExchanges):
            exchanges = self.agreement
            entry = self._guarded(op, where, lambda: exchanges.submit(sig, where, call, size_safe))
            handle = Handle(_Deferred(exchanges, entry), finish, self._describer(op, where))
            if not async_op:
                handle.wait()
            return handle
        if isinstance(self.agreement, LaggedChecks):
            self._guarded(op, where, lambda: self.agreement.launch(sig, where))
        return self._launch(op, where, call, finish, async_op)

    # ---- collectives --------------------------------------------------------------------------
    def all_reduce_(self, t: torch.Tensor, where: str, *, average: bool = False,
                    op: "dist.ReduceOp.RedOpType | None" = None, async_op: bool = False,
                    unit: int | None = None, post_scale: float | None = None) -> Handle:
        """In place. With `unit`, ranks check they reduce the same unit (rank agreement).
        post_scale: multiply the sum by it (instead of average's 1 / world_size)."""
        if self.world_size == 1:
            return Handle(None, None, self._describer("all_reduce", where), done=True)
        red = op if op is not None else dist.ReduceOp.SUM
        if post_scale is not None:
            finish = (lambda: t.mul_(post_scale)) if post_scale != 1.0 else None
        else:
            finish = (lambda: t.div_(self.world_size)) if average else None
        call = lambda: dist.all_reduce(require_backed(t, "all_reduce", where), red, async_op=True)  # noqa: E731
        if unit is None:
            return self._run("all_reduce", where, call, finish, async_op)
        # gloo's all-reduce aborts on a size mismatch: posted once the headers matched.
        return self._agreed("all_reduce", where, unit, t.numel() * t.element_size(), call, finish,
                            async_op, size_safe=False)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, where: str, *,
                       average: bool = True, async_op: bool = False, unit: int = -1,
                       post_scale: float | None = None) -> Handle:
        """out (numel = full.numel() / world) <- this rank's slice of the sum (mean) of `full`;
        post_scale: multiply the sum by it (instead of average's 1 / world_size).

        `full` is either flat or a (world_size, n) view whose rows are each contiguous (a column
        range of a flat buffer's rows, so buckets need no gathering copy). Row r is rank r's part.
        """
        n = out.numel()
        if full.numel() != n * self.world_size:
            raise ValueError(f"reduce_scatter for {where}: input has {full.numel()} elements, "
                             f"expected {n} x world_size {self.world_size}")
        rows = full.view(self.world_size, n) if full.dim() == 1 else full
        scale = post_scale if post_scale is not None else 1.0 / self.world_size if average else 1.0
        if self.world_size == 1:
            if out.data_ptr() != rows.data_ptr():  # not reduced in place (Unit reduces in place)
                out.copy_(rows[0].view_as(out))
            return Handle(None, None, self._describer("reduce_scatter", where), done=True)
        nbytes = full.numel() * full.element_size()
        if self.backend == "gloo":
            return self._exchange_reduce(out, rows, scale, where, async_op, unit, nbytes)
        flat = full if full.dim() == 1 else rows.contiguous().view(-1)
        return self._agreed("reduce_scatter", where, unit, nbytes,
                            lambda: dist.reduce_scatter_tensor(out, require_backed(flat, "reduce_scatter", where),
                                                               async_op=True),
                            (lambda: out.mul_(scale)) if scale != 1.0 else None, async_op)

    def all_gather(self, full: torch.Tensor, where: str, *, async_op: bool = False,
                   unit: int = -1) -> Handle:
        """Every rank's slice r of `full` (already filled locally) becomes visible to all ranks."""
        if self.world_size == 1:
            return Handle(None, None, self._describer("all_gather", where), done=True)
        n = full.numel() // self.world_size
        rows = full.view(self.world_size, n)
        if self.backend == "gloo":
            def exchange() -> _Works:
                require_backed(full, "all_gather", where)
                works = _Works([])
                for peer in self._peers():
                    _exchange_pieces(rows[self.rank], rows[peer], peer, works)
                return works
        else:
            def exchange() -> object:
                return dist.all_gather_into_tensor(require_backed(full, "all_gather", where),
                                                   rows[self.rank], async_op=True)
        return self._agreed("all_gather", where, unit, full.numel() * full.element_size(),
                            exchange, None, async_op)

    # ---- gloo point-to-point --------------------------------------------------------------------
    # Every rank issues its sends and receives in the same program order, and gloo matches
    # messages per (peer, tag) in order, so concurrent exchanges of different units pair up.
    def _peers(self) -> list[int]:
        return [p for p in range(self.world_size) if p != self.rank]

    def _exchange_reduce(self, out: torch.Tensor, rows: torch.Tensor, scale: float, where: str,
                         async_op: bool, unit: int, nbytes: int) -> Handle:
        """Reduce-scatter as a direct exchange: row p goes to rank p, our row comes from each."""
        received = torch.empty((self.world_size, rows.shape[1]), dtype=rows.dtype, device=rows.device)

        def exchange() -> _Works:
            require_backed(rows, "reduce_scatter", where)
            works = _Works([])
            for peer in self._peers():
                _exchange_pieces(rows[peer], received[peer], peer, works)
            return works

        def finish() -> None:
            if self.world_size == 2:  # one addition is commutative: the same bits on both ranks,
                # without staging our own row (3x faster than the general sum below, issue #29)
                torch.add(rows[self.rank], received[1 - self.rank], out=out.view(-1))
            else:  # in rank order, so the result does not depend on which rank computes it
                received[self.rank].copy_(rows[self.rank])
                torch.sum(received, dim=0, out=out.view(-1))
            if scale != 1.0:
                out.mul_(scale)
        return self._agreed("reduce_scatter", where, unit, nbytes, exchange, finish, async_op)

    def broadcast_(self, t: torch.Tensor, src: int, where: str) -> None:
        if self.world_size > 1:
            self._run("broadcast", where, lambda: dist.broadcast(require_backed(t, "broadcast", where), src,
                                                                 async_op=True), None, False)

    def max_flag(self, value: float, where: str) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        self.all_reduce_(t, where, op=dist.ReduceOp.MAX)
        return float(t.item())

    def flags_by_rank(self, flag: int, where: str) -> list[int]:
        """Every rank's small integer, on every rank (one all-reduce of a world-sized vector):
        which ranks failed a local step that must not be followed by collectives alone."""
        if self.world_size == 1:
            return [flag]
        t = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        t[self.rank] = flag
        self.all_reduce_(t, where)
        return [int(v) for v in t.cpu()]

    def barrier(self, where: str) -> None:
        if self.world_size > 1:
            self._run("barrier", where, lambda: dist.barrier(async_op=True), None, False)


class _Deferred:
    """The work of a gloo exchange: its data waited once the peers' headers agree."""

    def __init__(self, exchanges: HeaderedExchanges, entry: object):
        self.exchanges, self.entry = exchanges, entry

    def wait(self) -> None:
        self.exchanges.wait(self.entry)


class _Works:
    """Several backend works waited as one (the sends and receives of one exchange), then the
    copies out of receive staging buffers."""

    def __init__(self, works: list):
        self.works = works
        self.after: list[Callable[[], None]] = []

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        for copy_out in self.after:
            copy_out()


# Every gloo data message is at most this long and every receive has room for this many bytes:
# see [Note: rank agreement] in comm/agreement.py (gloo aborts the process on a message longer
# than its receive, and the headers that would tell are compared only later).
PIECE_BYTES = 1 << 20


def piece_starts(n: int, per: int) -> list[int]:
    """Starts of the `per`-element messages that cover an n-element row (n >= per): back to back,
    the last one ending at n and overlapping its predecessor, so every message is `per` long."""
    return list(range(0, n - per, per)) + [n - per]


def _exchange_pieces(send: torch.Tensor, recv: torch.Tensor, peer: int, works: _Works) -> None:
    """send -> peer and peer -> recv (both contiguous, equal length), in messages of exactly
    PIECE_BYTES; a row shorter than that travels whole and lands in a PIECE_BYTES staging buffer.
    gloo pairs messages per (peer, tag) in issue order, so pieces and exchanges pair up."""
    n, per = send.numel(), max(1, PIECE_BYTES // send.element_size())
    if n >= per:
        for lo in piece_starts(n, per):
            works.works.append(dist.isend(send[lo:lo + per], peer))
            works.works.append(dist.irecv(recv[lo:lo + per], peer))
        return
    staging = torch.empty(per, dtype=recv.dtype, device=recv.device)
    works.works.append(dist.isend(send, peer))
    works.works.append(dist.irecv(staging, peer))
    works.after.append(lambda: recv.copy_(staging[:n]))
