"""Where a checkpoint's saved inputs live between its forward and its backward.

[Note: kept activations]
A checkpoint saves only its inputs; everything inside it is recomputed in backward. Each saved
floating-point input goes through three optional steps, chosen by the options:
- partition_activations: the flat input is padded to a multiple of the model-parallel size N and
  this rank keeps its 1/N (the group's ranks hold identical copies, so together they hold it
  once); recomputation all-gathers it back;
- contiguous_memory_optimization: the kept piece is copied into slot k of a buffer allocated
  once, `number_checkpoints` slots per input position, so long-lived checkpoints do not leave
  holes between short-lived tensors;
- cpu_checkpointing: the kept piece lives in host memory (pinned, copied on a side stream where
  there is a GPU) and comes back before its backward: restoring checkpoint k starts fetching
  checkpoint k-1 (reverse order), so the next backward finds its input on the device.
The ledger counts the kept bytes as kind "activations" on their tier ("device" is the CPU on a
CPU-only machine, as for model states): with cpu_checkpointing the device tier holds only the
inputs being restored, about one layer's worth, instead of every layer's.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zerokit.activations.options import SETTINGS
from zerokit.tier_names import TierName

_names = itertools.count()


@dataclass
class Piece:
    """One saved input: what is kept of it, and how to make the whole again."""

    kept: torch.Tensor          # the whole input, or this rank's part of it; on `tier`
    tier: TierName              # DEVICE or HOST
    shape: torch.Size
    device: torch.device        # where the input was, and where it is restored to
    partitioned: bool
    name: str = ""
    ledger: Any = None                   # where `name` is counted (an engine's may replace it)
    source: torch.Tensor | None = None   # the device tensor an async host copy still reads
    event: Any = None                    # that copy's completion (CUDA)
    fetched: torch.Tensor | None = None  # the kept piece back on the device (prefetch)
    fetch_event: Any = None


@dataclass(eq=False)
class Kept:
    """The saved inputs of one checkpoint, in argument order (None where an argument is not an
    activation: kept as given).

    [Note: kept inputs live with the graph] Only the checkpoint's autograd node (its ctx) holds
    a Kept; the store's list of pending checkpoints holds weak references. A forward whose graph
    dies without a backward (an evaluation loss computed without no_grad, a checkpoint nested in
    another's no-grad forward) frees its inputs with the graph: a finalizer takes them off the
    ledger and out of the list. (A module-level list holding them leaked every such forward.)
    """

    pieces: list[Piece | None]
    others: list[Any]
    restored: bool = False
    releases: list = field(default_factory=list)
    held: list = field(default_factory=list)  # (ledger, name) still counted; shared with the finalizer


def is_activation(item: Any) -> bool:
    """DeepSpeed's rule: a floating-point tensor at least as large as the model-parallel group."""
    return torch.is_tensor(item) and item.is_floating_point() and item.numel() >= SETTINGS.mp.size


class Store:
    def __init__(self) -> None:
        # checkpoints kept in forward order, not yet restored: weak (see [Note: kept inputs
        # live with the graph])
        self.pending: list[weakref.ref] = []
        self.buffers: dict[int, torch.Tensor] = {}  # input position -> contiguous slots
        self.slot: dict[int, int] = {}
        self.buffer_ledgers: dict[int, Any] = {}  # where each buffer's bytes are counted
        self.stats = {"kept": 0, "restored": 0, "prefetched": 0}

    # ---- forward ------------------------------------------------------------------------------
    def keep(self, args: tuple) -> Kept:
        self._finish_copies()
        pieces: list[Piece | None] = []
        others: list[Any] = []
        for position, item in enumerate(args):
            if is_activation(item):
                pieces.append(self._keep_one(position, item.detach()))
                others.append(None)
            else:
                pieces.append(None)
                others.append(item)
        kept = Kept(pieces, others, held=[(p.ledger, p.name) for p in pieces if p is not None and p.name])
        ref = weakref.ref(kept)
        self.pending.append(ref)
        weakref.finalize(kept, self._dropped, ref, kept.held)  # the list, never the Kept
        self.stats["kept"] += 1
        return kept

    def _dropped(self, ref: weakref.ref, names: list) -> None:
        """A kept checkpoint was collected (restored, or its graph died without a backward)."""
        for ledger, name in names:  # those restore or reset did not release
            ledger.release(name)
        names.clear()
        self._forget(ref)

    def _forget(self, ref: weakref.ref) -> None:
        if ref in self.pending:
            self.pending.remove(ref)
            if not self.pending:  # every checkpoint of this forward is gone: the slots are free
                self.slot = dict.fromkeys(self.slot, 0)

    def alive(self) -> list[Kept]:
        """The kept checkpoints still pending, in forward order."""
        return [k for k in (r() for r in self.pending) if k is not None]

    def _keep_one(self, position: int, t: torch.Tensor) -> Piece:
        opts = SETTINGS.options
        part = self._partition(t) if opts.partition_activations and SETTINGS.mp.size > 1 else t
        tier = TierName.HOST if opts.cpu_checkpointing else TierName.DEVICE
        piece = Piece(part, tier, t.shape, t.device, part is not t)
        if opts.contiguous_memory_optimization:
            piece.kept = self._slot(position, part, tier)
            piece.source, piece.event = _copy_into(piece.kept, part)
            return piece  # the slot's bytes are counted once, as the buffer
        if tier is TierName.HOST:
            piece.kept = _empty_host(part)
            piece.source, piece.event = _copy_into(piece.kept, part)
        elif piece.partitioned:
            piece.kept = part.clone()  # the narrow view would keep the whole input alive
        piece.name, piece.ledger = f"activation:{next(_names)}", SETTINGS.ledger
        piece.ledger.hold_bytes(piece.name, "activations", tier, _nbytes(piece.kept))
        return piece

    @staticmethod
    def _partition(t: torch.Tensor) -> torch.Tensor:
        mp = SETTINGS.mp
        flat = t.reshape(-1)
        per = -(-flat.numel() // mp.size)
        lo, hi = min(mp.rank * per, flat.numel()), min((mp.rank + 1) * per, flat.numel())
        part = flat.new_zeros(per)  # this rank's 1/N, zero-padded past the end
        part[:hi - lo] = flat[lo:hi]
        return part

    def _slot(self, position: int, part: torch.Tensor, tier: str) -> torch.Tensor:
        slots = SETTINGS.options.number_checkpoints
        buf = self.buffers.get(position)
        if buf is None:
            device = "cpu" if tier is TierName.HOST else part.device
            buf = torch.empty((slots, part.numel()), dtype=part.dtype, device=device,
                              pin_memory=tier is TierName.HOST and part.is_cuda)
            self.buffers[position] = buf
            self.slot[position] = 0
            self.buffer_ledgers[position] = SETTINGS.ledger
            SETTINGS.ledger.hold_bytes(f"activation buffer {position}", "activations", tier, _nbytes(buf))
        if buf.shape[1] != part.numel() or buf.dtype != part.dtype:
            raise ValueError(
                f"contiguous_memory_optimization: input {position} of a checkpoint has "
                f"{part.numel()} {part.dtype} elements, its buffer's slots {buf.shape[1]} "
                f"{buf.dtype}; contiguous buffers need every checkpoint's inputs the same size")
        k = self.slot[position]
        if k >= slots:
            raise ValueError(
                f"contiguous_memory_optimization: more than number_checkpoints={slots} checkpoints "
                f"in one forward (input {position}); set number_checkpoints to the number of "
                f"checkpoints a forward makes, or call zerokit.activations.reset() between "
                f"forwards that have no backward")
        self.slot[position] = k + 1
        return buf[k].view(part.shape)

    def _finish_copies(self) -> None:
        """Let go of device inputs whose host copies have landed (CUDA's copies are async)."""
        for kept in self.alive():
            for piece in kept.pieces:
                if piece is not None and piece.event is not None and piece.event.query():
                    piece.source = piece.event = None

    # ---- backward -----------------------------------------------------------------------------
    def restore(self, kept: Kept) -> list[Any]:
        """The inputs as given to the checkpoint, on their devices; starts the previous
        checkpoint's fetch (see [Note: kept activations])."""
        alive = self.alive()
        index = next((i for i, k in enumerate(alive) if k is kept), None)
        if index is None:
            raise RuntimeError("zerokit.activations: backward through a checkpoint whose kept "
                               "inputs were dropped by reset() or configure() after its forward")
        if index > 0:
            self._prefetch(alive[index - 1])
        args = [other if piece is None else self._whole(piece, kept)
                for piece, other in zip(kept.pieces, kept.others)]
        self.stats["restored"] += 1
        self._forget(weakref.ref(kept))
        return args

    def _prefetch(self, kept: Kept) -> None:
        """Start bringing a checkpoint's host pieces back, where a copy can run beside compute."""
        for piece in kept.pieces:
            if piece is not None and piece.tier is TierName.HOST and piece.device.type == "cuda" \
                    and piece.fetched is None:
                piece.fetched, piece.fetch_event = _fetch(piece)
                self.stats["prefetched"] += 1

    def _whole(self, piece: Piece, kept: Kept) -> torch.Tensor:
        here = piece.kept
        source = restore_source(piece.tier, piece.event is not None)
        if source == "slot":
            torch.cuda.current_stream(piece.device).wait_event(piece.event)
        elif source == "fetch":
            if piece.fetched is None:
                piece.fetched, piece.fetch_event = _fetch(piece)
            if piece.fetch_event is not None:
                torch.cuda.current_stream(piece.device).wait_event(piece.fetch_event)
            here = piece.fetched
            kept.releases.append(SETTINGS.ledger.transient("activations", here, tier=TierName.DEVICE))
        if piece.partitioned:
            here = self._gather(here, piece)
            kept.releases.append(SETTINGS.ledger.transient("activations", here, tier=TierName.DEVICE))
        if piece.name:
            piece.ledger.release(piece.name)
            kept.held.remove((piece.ledger, piece.name))
        return here.reshape(-1)[:piece.shape.numel()].view(piece.shape)

    @staticmethod
    def _gather(part: torch.Tensor, piece: Piece) -> torch.Tensor:
        mp = SETTINGS.mp
        whole = part.new_empty(mp.size * part.numel())
        dist.all_gather(list(whole.chunk(mp.size)), part.contiguous(), group=mp.group)
        return whole

    def done(self, kept: Kept) -> None:
        """The checkpoint's backward finished: its restored inputs leave the ledger."""
        for release in kept.releases:
            release()
        kept.releases.clear()

    def reset(self) -> None:
        """Forget every kept checkpoint and the contiguous buffers (DeepSpeed's reset(), for
        forwards that have no backward, as evaluation)."""
        for kept in self.alive():
            for ledger, name in kept.held:
                ledger.release(name)
            kept.held.clear()
        for position, ledger in self.buffer_ledgers.items():
            ledger.release(f"activation buffer {position}")
        self.__init__()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _empty_host(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=like.is_cuda)


def _copy_into(dest: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor | None, Any]:
    """Copy src into dest; on CUDA on the side stream: (src to keep alive, event), else (None, None)."""
    if not (src.is_cuda or dest.is_cuda):
        dest.copy_(src)
        return None, None
    from zerokit.tiers.transfer import side_stream

    gpu = src.device if src.is_cuda else dest.device
    side = side_stream(gpu)
    side.wait_stream(torch.cuda.current_stream(gpu))  # src (or dest) was made there
    with torch.cuda.stream(side):
        dest.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    return src, event


def _fetch(piece: Piece) -> tuple[torch.Tensor, Any]:
    """The kept piece back on the input's device: (tensor, event to wait for, or None)."""
    if piece.event is not None:  # the host copy may still be in flight: its source is the answer
        return piece.source, None
    dest = torch.empty(piece.kept.shape, dtype=piece.kept.dtype, device=piece.device)
    _src, event = _copy_into(dest, piece.kept)
    return dest, event


STORE = Store()


def restore_source(tier: TierName, copied_on_side_stream: bool) -> str:
    """Where a checkpointed input is read back from at recomputation:
    "slot"   a device slot (contiguous buffer) filled on the CUDA side stream: wait for that copy
             and read the slot (fetching would hand back the source, alive beside its slot: the
             bug the H100 run found);
    "fetch"  a host piece: bring it back to the device (prefetched, or now);
    "kept"   a device piece kept as it was: read it.
    """
    if tier == TierName.DEVICE:
        return "slot" if copied_on_side_stream else "kept"
    if tier == TierName.HOST:
        return "fetch"
    raise ValueError(f"a checkpointed piece lives on 'device' or 'host', not {tier!r}")
