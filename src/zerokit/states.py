"""The states of the objects that own training state, with the moves each may make.

[Note: state machines]
Five owners change state as training runs: a unit's full weights (`WeightState`), an optimizer
executor (`ExecutorState`), the engine (`TrainingState`), a stage-3 weight shard's host buffer
on the nvme tier (`ShardResidency`) and a TensorSwapper key (`SwapState`). Each enum has a
table of legal moves (`LEGAL`) and owners change state only through `move(current, new, who)`, which raises
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
    the shard's own state (`ShardResidency`, below), not a state of the unit."""

    SHARDED = "sharded"      # only this rank's shard exists; `flat` has no storage (stage 3)
    GATHERING = "gathering"  # an all-gather into `flat` is in flight: do not read `flat`
    GATHERED = "gathered"    # `flat` holds every rank's shard: parameters can be used


class ExecutorState(Enum):
    """An optimizer executor's update (parts/executors.py)."""

    IDLE = "idle"                   # nothing in flight; the weights hold its last update
    RUNNING = "running"             # an update runs (the delayed one into the next step)
    WRITE_BACK_PENDING = "write-back pending"  # the update is done; its weights are not written
    # a speculative update (step_in_backward) is done; the step decides: commit or roll back
    # (see [Note: the speculative step] in parts/speculation.py)
    SPECULATED = "speculated"


class TrainingState(Enum):
    """What the engine is doing: hooks consult it (recomputation is not a forward), and a failure
    report says it as the rank's position (engine/health.py `describe_position`)."""

    IDLE = "idle"
    FORWARD = "forward"
    RECOMPUTE = "recompute"  # a forward run again inside backward (activation checkpointing)
    BACKWARD = "backward"
    STEP = "step"  # the optimizer step at an accumulation boundary (Engine.step)
    # A step failed leaving state no later step may build on (a collective the ranks may not
    # agree on; NVMe-resident master or optimizer state partly written): terminal.
    FAILED = "failed"


class ShardResidency(Enum):
    """A stage-3 weight shard's host buffer on the nvme tier (see [Note: weight shards on NVMe]
    in tiers/nvme_shard.py)."""

    EMPTY = "empty"        # no storage; the file holds the values
    READING = "reading"    # a read of the file into it is in flight
    RESIDENT = "resident"  # it holds the file's values, until a gather copied them


class SwapState(Enum):
    """One version of a TensorSwapper key (tiers/nvme_swapper.py). A failed write drops its version (the
    previous one, if any, stays): that is no move, the version is gone."""

    WRITING = "writing"          # swap_out submitted, not yet landed
    NVME = "nvme"                # on disk only
    PREFETCHING = "prefetching"  # a read into a host buffer is in flight
    PREFETCHED = "prefetched"    # on disk and in a host buffer (swap_in takes it)


LEGAL: dict[Enum, frozenset] = {
    WeightState.SHARDED: frozenset({WeightState.GATHERING}),
    WeightState.GATHERING: frozenset({WeightState.GATHERED}),
    # release, or a re-publish of new weights into a unit that stays gathered
    WeightState.GATHERED: frozenset({WeightState.SHARDED, WeightState.GATHERING}),
    ExecutorState.IDLE: frozenset({ExecutorState.RUNNING, ExecutorState.WRITE_BACK_PENDING}),
    ExecutorState.RUNNING: frozenset({ExecutorState.IDLE, ExecutorState.WRITE_BACK_PENDING,
                                      ExecutorState.SPECULATED}),
    ExecutorState.WRITE_BACK_PENDING: frozenset({ExecutorState.IDLE}),
    # a state reader ended the worker and backward offers more (RUNNING), committed (its
    # weights to write back), rolled back (IDLE)
    ExecutorState.SPECULATED: frozenset({ExecutorState.RUNNING, ExecutorState.WRITE_BACK_PENDING,
                                         ExecutorState.IDLE}),
    TrainingState.IDLE: frozenset({TrainingState.FORWARD, TrainingState.BACKWARD, TrainingState.STEP}),
    TrainingState.FORWARD: frozenset({TrainingState.IDLE}),
    TrainingState.BACKWARD: frozenset({TrainingState.IDLE, TrainingState.RECOMPUTE}),
    # back to backward when the recomputed module returns; idle when backward raised inside it
    TrainingState.RECOMPUTE: frozenset({TrainingState.BACKWARD, TrainingState.IDLE}),
    # a step ends idle, or failed when it left state no later step may build on (Engine._fail)
    TrainingState.STEP: frozenset({TrainingState.IDLE, TrainingState.FAILED}),
    TrainingState.FAILED: frozenset(),
    ShardResidency.EMPTY: frozenset({ShardResidency.READING}),
    # the read landed, or failed (the buffer is freed: read again next time)
    ShardResidency.READING: frozenset({ShardResidency.RESIDENT, ShardResidency.EMPTY}),
    ShardResidency.RESIDENT: frozenset({ShardResidency.EMPTY}),
    SwapState.WRITING: frozenset({SwapState.NVME}),
    SwapState.NVME: frozenset({SwapState.PREFETCHING}),
    # the read landed; or swap_in (or a replacing write) took the read still in flight
    SwapState.PREFETCHING: frozenset({SwapState.PREFETCHED, SwapState.NVME}),
    SwapState.PREFETCHED: frozenset({SwapState.NVME}),
}


def move(current: Enum, new: Enum, who: str) -> Enum:
    """`new`, if the table allows current -> new; else raises IllegalTransition."""
    allowed = LEGAL[current]
    if new not in allowed:
        raise IllegalTransition(
            f"{who}: illegal state change {current.value!r} -> {new.value!r}; from "
            f"{current.value!r} the legal moves are {sorted(s.value for s in allowed)}")
    return new
