"""The speculative step: offloaded parts stepped in backward, then committed or rolled back.

[Note: the speculative step]
With offload_optimizer.step_in_backward, a unit's host and nvme parts step on their executor's
worker as soon as backward has reduced the unit's gradient, with the coefficient known then:
1 / loss scale, unclipped. Whether that was the step's update is known only after the step's one
all-reduce (engine/health.py reduce_step_scalars: the norm, the non-finite flags): the update
applied in backward is a `SpeculativeStep`, a record of the parts stepped under it, which the
engine (Engine._settle_speculation) then
    commits     no clipping applies and every gradient is finite: the update stands; nothing is
                copied (host restores are dropped, nvme parts switch to the slot just written)
    redoes      clipping applies: every part is restored and stepped again in step(), with the
                clipped coefficient, from the same held gradient
    skips       an fp16 overflow or a non-finite gradient: every part is restored and stays so
So `step()` leaves master, optimizer state and weights bit-equal to stepping in step().

What a restore needs, per part kind:
    host part   `HostRestore`: a copy of its master, state and 16-bit output taken on the worker
                just before the kernel overwrites them, copied back on a rollback (ledger kind
                "restores", host tier; one set per part, reused every step)
    nvme part   nothing copied: the stream writes the new master and state to the part's other
                file slot (parts/nvme.py `NvmeSlots`); a commit switches the live slot, a
                rollback leaves it (checkpoints and resume read the live slot)
    both        the gradient stays held in host memory until the step decides
                (parts/held_gradient.py), so a redo steps from the same values.
Whether the host can hold the restores is decided at initialize (engine/assemble.py,
`restore_bytes`): when it cannot, the engine says so and steps in step() instead.
"""
from __future__ import annotations

import dataclasses
import threading

import torch

from zerokit.tier_names import TierName


@dataclasses.dataclass
class SpeculationCounts:
    """Steps whose speculative update was committed, redone (clipping applied) or skipped (the
    step was: overflow or non-finite), the seconds the redos took, and the steps that did not
    speculate because the step before them was clipped (held back: offload_optimizer.speculation
    'adaptive'; they step in step()) (engine.speculation)."""

    committed: int = 0
    redone: int = 0
    skipped: int = 0
    redo_s: float = 0.0
    held_back: int = 0

    def line(self) -> str:
        return (f"speculative steps: committed {self.committed}, redone {self.redone} "
                f"({self.redo_s:.3f} s), skipped {self.skipped}, held back {self.held_back}")


def settle(executors: list, coef: float, overflow: bool, counts: SpeculationCounts) -> bool:
    """The step has decided (Engine._update): the update applied in backward stands when it used
    the step's coefficient `coef` (no clipping applied) and nothing overflowed; else it is rolled
    back, to be stepped again with `coef` (returns True: a redo) or left so for a skipped step."""
    pending = [e for e in executors if e.speculation is not None]
    if not pending:
        return False
    commit = not overflow and all(e.speculation.coef == coef for e in pending)
    for executor in pending:
        executor.settle(commit, skipped=overflow)
    if commit:
        counts.committed += 1
    elif overflow:
        counts.skipped += 1
    else:
        counts.redone += 1
    return not commit and not overflow


class HostRestore:
    """A host part's master, optimizer state and 16-bit output as they were before its
    speculative update (see the note); allocated once, on the host tier, kind "restores".
    It keeps no reference to its part (the part holds it: a back reference would be a cycle that
    only a gc pass frees, and a dropped engine must free its buffers without one)."""

    def __init__(self, part, tier):
        name = f"{part.unit.name}/host_restore"
        self.master = tier.allocate(f"{name}.master", "restores", part.numel, part.master.dtype)
        self.state = {k: tier.allocate(f"{name}.{k}", "restores", part.numel, v.dtype)
                      for k, v in part.state.items()}
        out = part.out16
        self.out16 = None if out is None else tier.allocate(f"{name}.out16", "restores",
                                                            part.numel, out.dtype)
        self.saved = False  # holds the state before an update not yet committed or rolled back

    def save(self, p) -> None:
        self.saved = True
        self.master.copy_(p.master)
        for k, v in p.state.items():
            self.state[k].copy_(v)
        if self.out16 is not None:
            self.out16.copy_(p.out16)

    def restore(self, p) -> None:
        self.saved = False
        p.master.copy_(self.master)
        for k, v in p.state.items():
            v.copy_(self.state[k])
        if self.out16 is not None:
            p.out16.copy_(self.out16)


def restore_bytes(host_numel: int, nvme_numel: int, state_per_element: int, out16_bytes: int
                  ) -> tuple[int, int]:
    """(host, nvme) bytes the restores of one rank's parts take (see the note): the host parts'
    copies of master, state and 16-bit output; the nvme parts' second file slot of master and
    state. The gradients held until the decision are counted with the gradients."""
    host = host_numel * (4 + state_per_element + out16_bytes)
    return host, nvme_numel * (4 + state_per_element)


class SpeculativeStep:
    """One step's speculative update: the parts its worker stepped, the coefficient it used.

    The executor's worker calls `before(part)` just before it steps a part; the training thread,
    once the worker is joined, `commit()`s or `roll_back()`s every part stepped.
    """

    def __init__(self, coef: float):
        self.coef = coef
        self.parts: list = []
        self._lock = threading.Lock()

    def before(self, part) -> None:
        """On the worker: `part` is about to be stepped under this speculation."""
        if part.tier is TierName.HOST:
            part.restore.save(part)
        else:
            part.slots.write_other()
        with self._lock:
            self.parts.append(part)

    def commit(self) -> None:
        for p in self.parts:
            if p.tier is TierName.NVME:
                p.slots.switch()
            else:
                p.restore.saved = False
        self.parts = []

    def roll_back(self, skipped: bool) -> None:
        """Every part as before its speculative update (its step count too); `skipped`: the
        step is skipped, so the weights the update wrote go back too (a redo rewrites them)."""
        for p in self.parts:
            p.steps -= 1
            if p.tier is TierName.HOST:
                p.restore.restore(p)
            else:
                p.roll_back(skipped)
        self.parts = []
