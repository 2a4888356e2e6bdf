"""Where a rank is, and whether its numbers are finite: what a failure report and a step need.

[Note: non-finite steps]
With fp16 an overflow is expected (the loss scale is too high): the step is skipped and the
scale lowered. With bf16 and fp32 a non-finite loss or gradient is a fault: it must never reach
the weights, and the report must say where it came from. So every boundary step computes the
global gradient norm (one scalar all-reduce where gradients are sharded, the same one clipping
needs) and counts the non-finite losses of its micro-steps (a device flag, no host read per
micro-step), both in that one all-reduce. When either is non-finite, a second all-reduce (only
then) of per-unit flags finds the first unit holding a non-finite gradient, and the step is
skipped and counted in `skipped_steps` (`nonfinite: "skip"`, the default) or raises
`NonFiniteError` on every rank (`"stop"`), leaving the engine as after a skipped step.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from zerokit.comm.collectives import CollectiveError

if TYPE_CHECKING:
    from zerokit.comm.collectives import Comm
    from zerokit.units.unit import Unit
    from zerokit.engine.engine import Engine

log = logging.getLogger("zerokit")


class NonFiniteError(FloatingPointError):
    """A non-finite loss or gradient norm with `nonfinite: "stop"`; names the step and unit."""


def describe_position(engine: "Engine") -> str:
    """This rank's place in its schedule, for failure reports (each rank reports its own)."""
    text = (f"global step {engine.global_steps}, {engine.training_state.value} "
            f"(micro-step {engine.micro_steps})")
    where = engine.scheduler.position()  # None where no order of uses is kept (stages 0-2)
    return f"{text}, {where}" if where else text


@dataclass
class StepScalars:
    """What every boundary step agrees on in one all-reduce."""

    grad_norm: float         # global L2 norm of the (scaled) gradients; inf when not finite
    nonfinite_losses: int    # micro-steps since the last step whose loss was not finite, all ranks
    preempted: bool          # some rank received SIGTERM (see engine/preemption.py)
    unused: list             # units no rank produced a gradient for since the last step
    abandoned_by: list       # ranks whose previous step was abandoned (their optimizer raised)


class LossWatch:
    """Counts non-finite losses on the device, read only at the step (no sync per micro-step)."""

    def __init__(self) -> None:
        self._bad: torch.Tensor | None = None

    def note(self, loss: torch.Tensor) -> None:
        bad = (~torch.isfinite(loss.detach())).to(torch.float64).reshape(())
        self._bad = bad if self._bad is None else self._bad + bad

    def take(self, device: torch.device) -> torch.Tensor:
        bad = self._bad if self._bad is not None else torch.zeros((), dtype=torch.float64)
        self._bad = None
        return bad.to(device)


def reduce_step_scalars(units: list["Unit"], comm: "Comm", sharded: bool, losses: LossWatch,
                        preempted: bool, abandoned: bool = False) -> StepScalars:
    """The gradient norm, the non-finite-loss count, the preemption flag, the used-units flags
    (see Engine._unused_everywhere) and one abandoned-step flag per rank, in one all-reduce: the step's only one besides the weights'
    (none at world size 1; at stage 0 the norm is local, the rest still needs the reduction)."""
    local = torch.zeros((), dtype=torch.float64, device=comm.device)
    for u in units:
        local += u.grad_sq_norm()
    by_rank = [0.0] * comm.world_size
    by_rank[comm.rank] = float(abandoned)
    flags = torch.tensor([float(preempted)] + [float(u.used) for u in units] + by_rank,
                         dtype=torch.float64)
    values = torch.cat([torch.stack([local if sharded else torch.zeros_like(local),
                                     losses.take(comm.device)]), flags.to(comm.device)])
    if comm.world_size > 1:
        comm.all_reduce_(values, "the global gradient norm and step flags")
    sq, bad, stop, *rest = values.tolist()  # the one host read of the step
    used, by_rank = rest[:len(units)], rest[len(units):]
    if not sharded:
        sq = local.item()
    return StepScalars(math.sqrt(sq) if math.isfinite(sq) else math.inf, int(bad) if
                       math.isfinite(bad) else 1, stop > 0,
                       [u for u, n in zip(units, used) if not n > 0],
                       [r for r, f in enumerate(by_rank) if f > 0])


def first_nonfinite_unit(units: list["Unit"], comm: "Comm", sharded: bool) -> "Unit | None":
    """The first unit (in unit order) holding a non-finite gradient on any rank (one more
    all-reduce, only on the rare step that needs it)."""
    flags = torch.stack([~torch.isfinite(u.grad_sq_norm()) for u in units]).to(torch.float64) \
        if units else torch.zeros(0, dtype=torch.float64)
    flags = flags.to(comm.device)
    if comm.world_size > 1 and sharded:
        comm.all_reduce_(flags, "the non-finite-gradient flags per unit")
    return next((u for u, f in zip(units, flags.tolist()) if f > 0), None)


def nonfinite_report(step: int, scalars: StepScalars, unit: "Unit | None", action: str) -> str:
    what = []
    if scalars.nonfinite_losses:
        what.append(f"{scalars.nonfinite_losses} non-finite loss(es) since the last step")
    if not math.isfinite(scalars.grad_norm):
        where = (f"first in unit '{unit.name}' ({', '.join(unit.param_fqns()[:4])}"
                 f"{' ...' if len(unit.slots) > 4 else ''})" if unit is not None else
                 "in no single unit (the sum overflowed)")
        what.append(f"a non-finite gradient norm, {where}")
    return (f"zerokit: step {step}: {' and '.join(what)}; {action} (config key "
            f"'nonfinite': 'skip' skips such steps and counts them in skipped_steps, 'stop' raises)")


def handle_nonfinite(engine: "Engine", trainable: list["Unit"], scalars: StepScalars) -> None:
    """bf16 / fp32: report the step and the first unit; raise for `nonfinite: "stop"` (the
    engine then abandons the step, see Engine._abandon_step), else the caller skips it."""
    unit = (first_nonfinite_unit(trainable, engine.comm, engine.policy.shard_optimizer)
            if not math.isfinite(scalars.grad_norm) else None)
    applied = engine.stepped_in_backward  # offload_optimizer.step_in_backward: too late to skip
    stop = engine.config.nonfinite == "stop" or applied
    text = nonfinite_report(engine.global_steps, scalars, unit,
                            "stopping: offload_optimizer.step_in_backward already applied the "
                            "offloaded update during backward, it cannot be skipped" if applied else
                            "stopping" if stop else f"step skipped ({engine.skipped_steps + 1} "
                                                    f"skipped so far)")
    if stop:
        raise NonFiniteError(text)
    if engine.comm.rank == 0:
        log.warning(text)


def check_replicas_agree(mine: int | None, abandoned_by: list[int], comm, shard_optimizer: bool
                         ) -> None:
    """Some ranks abandoned their last step (`mine`: this rank's, if it did) while others applied
    it. Where the optimizer state is partitioned each rank steps only its own shard, so every
    rank still gathers the same weights (that shard missed one update); where it is replicated
    (stage 0) the replicas now differ, and training on would be silently wrong."""
    if not abandoned_by or len(abandoned_by) == comm.world_size:
        return
    applied = [r for r in range(comm.world_size) if r not in abandoned_by]
    what = (f"rank(s) {abandoned_by} abandoned their previous step (their optimizer raised) "
            f"while rank(s) {applied} applied it")
    if shard_optimizer:
        if comm.rank == 0:
            log.warning("zerokit: %s; the shards of rank(s) %s missed that one update", what,
                        abandoned_by)
        return
    raise CollectiveError(
        f"rank {comm.rank}: {what}{f' (this rank, at step {mine})' if mine is not None else ''}. "
        f"Every rank keeps a full replica of the weights here, so the replicas now differ: "
        f"restart from the last checkpoint.")
