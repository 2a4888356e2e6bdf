"""The states of the objects that own training state, with the moves each may make.

[Note: state machines]
Three owners change state as training runs: a unit's full weights (`WeightState`), an optimizer
executor (`ExecutorState`) and the engine (`TrainingState`). Each enum has a table of legal moves
(`LEGAL`) and owners change state only through `move(current, new, who)`, which raises
`IllegalTransition` naming the owner, both states and the moves allowed: a bug that would have
read half-gathered weights or joined a worker twice fails where it happens. Asking for the state
one is already in is the caller's decision (hooks may ask twice; they check first), never a move.
"""
from __future__ import annotations

from enum import Enum


class IllegalTransition(RuntimeError):
    """A state owner was asked to make a move its transition table does not allow."""


class EngineFailedError(RuntimeError):
    """The engine is FAILED (see TrainingState): the message says which step failed, how, and
    what to do (restart, or load the last checkpoint into a new engine)."""


class WeightState(Enum):
    """Where a unit's full compute weights are. Whether a shard on NVMe is in host memory too is
    the shard's own state (`ShardResidency` in tiers/nvme_shard.py), not a state of the unit."""

    SHARDED = "sharded"      # only this rank's shard exists; `flat` has no storage (stage 3)
    GATHERING = "gathering"  # an all-gather into `flat` is in flight: do not read `flat`
    GATHERED = "gathered"    # `flat` holds every rank's shard: parameters can be used


class ExecutorState(Enum):
    """An optimizer executor's update (parts/executors.py)."""

    IDLE = "idle"                   # nothing in flight; the weights hold its last update
    RUNNING = "running"             # an update runs (the delayed one into the next step)
    WRITE_BACK_PENDING = "write-back pending"  # the update is done; its weights are not written


class TrainingState(Enum):
    """What the engine is doing, which hooks consult (recomputation is not a forward)."""

    IDLE = "idle"
    FORWARD = "forward"
    RECOMPUTE = "recompute"  # a forward run again inside backward (activation checkpointing)
    BACKWARD = "backward"
    # A step failed leaving state no later step may build on (a collective the ranks may not
    # agree on; NVMe-resident master or optimizer state partly written): terminal.
    FAILED = "failed"


LEGAL: dict[Enum, frozenset] = {
    WeightState.SHARDED: frozenset({WeightState.GATHERING}),
    WeightState.GATHERING: frozenset({WeightState.GATHERED}),
    # release, or a re-publish of new weights into a unit that stays gathered
    WeightState.GATHERED: frozenset({WeightState.SHARDED, WeightState.GATHERING}),
    ExecutorState.IDLE: frozenset({ExecutorState.RUNNING, ExecutorState.WRITE_BACK_PENDING}),
    ExecutorState.RUNNING: frozenset({ExecutorState.IDLE, ExecutorState.WRITE_BACK_PENDING}),
    ExecutorState.WRITE_BACK_PENDING: frozenset({ExecutorState.IDLE}),
    TrainingState.IDLE: frozenset({TrainingState.FORWARD, TrainingState.BACKWARD, TrainingState.FAILED}),
    TrainingState.FORWARD: frozenset({TrainingState.IDLE}),
    TrainingState.BACKWARD: frozenset({TrainingState.IDLE, TrainingState.RECOMPUTE}),
    # back to backward when the recomputed module returns; idle when backward raised inside it
    TrainingState.RECOMPUTE: frozenset({TrainingState.BACKWARD, TrainingState.IDLE}),
    TrainingState.FAILED: frozenset(),
}


def move(current: Enum, new: Enum, who: str) -> Enum:
    """`new`, if the table allows current -> new; else raises IllegalTransition."""
    allowed = LEGAL[current]
    if new not in allowed:
        raise IllegalTransition(
            f"{who}: illegal state change {current.value!r} -> {new.value!r}; from "
            f"{current.value!r} the legal moves are {sorted(s.value for s in allowed)}")
    return new
