"""Bucket, prefetch and sub-group sizes from measured facts, beside the placement planner.

[Note: choosing the sizes]
When the placement planner runs (engine/planner.py, [Note: the placement planner]), it also
chooses the size keys the config leaves out; a key the config sets (a number, or "auto", which
is the HF Trainer's hidden-size rule) is kept. Facts: the all-gather's latency alpha and
bandwidth beta (engine/bandwidths.py, [Note: the all-gather probe]; a reduce-scatter moves the
same bytes, so the gradients' collectives are sized from it too), the units' padded element
counts, the element sizes, and the engine's own byte rules for what a size costs: the reductions
in flight (byte_plan.py `reduce_buffer_bytes`) and stage 3's gathered peak (the scheduler itself,
gathered_peak.py). The rules, each a bound that the log line names:
- reduce_bucket_size (world > 1): a collective of B bytes spends alpha of alpha + B / beta on
  latency, <= 5% when B >= 19 alpha beta ("latency"); and at least the largest unit's gradient,
  so that one unit reduces in one collective ("unit"): more buys nothing (a unit's gradient
  is reduced when it is complete, never merged with another's) and costs memory, since the
  engine lets 2 buckets of reductions be in flight beside the newest unit's.
- stage3_prefetch_bucket_size (stage 3, world > 1): the largest unit gathered per use (not the
  root's, gathered for the whole step; not those under stage3_param_persistence_threshold), so
  the next unit, whichever it is, is gathered while the current one computes ("unit"). One unit
  ahead is enough: while the gather takes longer than the compute the link stays busy anyway,
  and more ahead only holds more memory. At most stage3_max_live_parameters less that unit
  (the unit in use is live beside it, "max_live").
- the budget: when no placement fits with the sizes above, the sizes give up the bytes the
  placement closest to fitting lacks in the budget that holds the transients (the device
  budget on a GPU, the host's on a CPU device): first the bucket down to its latency floor (a
  unit then reduces in pieces, each still efficient), then below it (the reductions overlap
  backward), then the prefetch (a gather not prefetched stalls the compute for its whole time,
  twice a step), each the largest that fits ("budget"). Memory is the hard bound, time the soft.
- sub_group_size (where the optimizer may stream from NVMe): the stream's buffer sets hold
  buffer_count x sub_group_size x bytes per element of host RAM (parts/nvme_executor.py
  `buffer_set_bytes`), RAM that max_in_cpu could keep instead, and the time model does not see
  the size: so the smallest whose every file request (the smallest file's element size x
  sub_group_size) is as large as the disk probe's requests (bandwidths.DISK_REQUEST_BYTES, the
  size the measured rate holds for) and as the aio engine's queue (block_size x queue_depth x
  threads: one request fills it alone) ("disk"). Written into the placement's search, so the
  max_in_cpu bisection counts it; kept out of the config when the chosen placement does not
  stream (there it means nothing).
World 1: nothing is measured and there are no collectives to size: the bucket and prefetch keys
stay as configured (the explanation says so). The chosen keys go into the config (and
engine.config's dict) as if set by hand, and into `Plan.sizes`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from zerokit.engine import bandwidths, bf16_state, planner
from zerokit.engine.bandwidths import AllGatherRate
from zerokit.engine.byte_plan import reduce_buffer_bytes
from zerokit.engine.gathered_peak import gathered_peak_numel
from zerokit.policy import PlacementPolicy
from zerokit.policy.layout import ALIGN
from zerokit.sizes import mib

LATENCY_SHARE = 0.05  # of a collective's time, at most, spent on its latency
BUCKET, PREFETCH, SUB_GROUP = "reduce_bucket_size", "stage3_prefetch_bucket_size", "sub_group_size"
KEYS = (BUCKET, PREFETCH, SUB_GROUP)


@dataclass(frozen=True)
class SizeFacts:
    """What the rules read (see [Note: choosing the sizes]); tests inject every field."""

    world: int
    gather: AllGatherRate | None            # None at world 1
    grad_numels: tuple[int, ...]            # padded elements of each unit with a gradient
    gathered_numels: tuple[int, ...]        # stage 3: of each unit gathered per use; () below
    reduce_element: int                     # bytes per element of the gradients' collectives
    max_live: int                           # stage3_max_live_parameters
    configured: dict                        # KEYS -> the config's value
    free: frozenset                         # KEYS the config leaves out
    stream_element: int | None = None       # bytes per element of the NVMe stream's smallest file;
                                            # None: the optimizer cannot stream from NVMe
    request_bytes: int = bandwidths.DISK_REQUEST_BYTES
    reduction_bytes: Callable[[int], int] = lambda bucket: 0      # reductions in flight
    gathered_bytes: Callable[[int], int] = lambda prefetch: 0     # stage 3's gathered peak

    def transients(self, values: dict) -> int:
        return self.reduction_bytes(values[BUCKET]) + self.gathered_bytes(values[PREFETCH])


@dataclass
class Sizes:
    values: dict                            # KEYS -> the value the engine runs
    chosen: dict                            # the keys chosen here -> value (into the config)
    bound: dict                             # chosen key -> latency, unit, max_live, budget, disk
    why: dict                               # key -> the reason shown
    gather: AllGatherRate | None = None
    room: int | None = None                 # transient bytes the budget left (the budget bound)
    transient_bytes: int = 0
    gathered_bytes: int = 0                 # of transient_bytes: stage 3's gathered peak

    def explain(self) -> str:
        head = (f"sizes: {self.gather.describe()}" if self.gather else
                "sizes: world 1: no all-gather measured and no collectives to size")
        if self.room is not None:
            head += f"; the budget leaves {mib(self.room)} for the transients"
        return "\n".join([head] + [f"  {k} {self.values[k]:,} elements: {self.why[k]}"
                                   for k in KEYS if k in self.why])


def _round_up(x: int, grain: int) -> int:
    return -(-x // grain) * grain


def latency_floor_bytes(gather: AllGatherRate) -> float:
    """The smallest collective whose latency is at most LATENCY_SHARE of its time."""
    return (1 - LATENCY_SHARE) / LATENCY_SHARE * gather.alpha * gather.beta


def choose_sizes(facts: SizeFacts, room: int | None = None) -> Sizes:
    """The sizes of [Note: choosing the sizes]; room: the bytes the transients may take (None:
    not bounded)."""
    values, chosen, bound, why = dict(facts.configured), {}, {}, {}
    for k in KEYS:
        if k not in facts.free:
            why[k] = "set in the config, kept"
    grain = facts.world * ALIGN  # the smallest collective a unit issues (units/unit.py)
    g = facts.gather
    lat = 0
    if g is not None:
        lat = _round_up(math.ceil(latency_floor_bytes(g) / facts.reduce_element), grain)
    if BUCKET in facts.free and g is not None and facts.grad_numels:
        unit = max(facts.grad_numels)
        values[BUCKET] = max(lat, unit, grain)
        bound[BUCKET] = "latency" if lat > unit else "unit"
    if PREFETCH in facts.free and g is not None and facts.gathered_numels:
        unit = max(facts.gathered_numels)
        values[PREFETCH] = max(0, min(unit, facts.max_live - unit))
        bound[PREFETCH] = "unit" if values[PREFETCH] == unit else "max_live"
    if SUB_GROUP in facts.free and facts.stream_element:
        values[SUB_GROUP] = min(facts.configured[SUB_GROUP],
                                _round_up(facts.request_bytes, facts.stream_element) // facts.stream_element)
        bound[SUB_GROUP] = "disk"
    if room is not None:
        _within(facts, values, bound, room, lat, grain)
    for k in bound:
        chosen[k] = values[k]
        why[k] = _why(k, bound[k], facts, values, lat)
    return Sizes(values, chosen, bound, why, g, room, facts.transients(values),
                 facts.gathered_bytes(values[PREFETCH]))


def _within(facts: SizeFacts, values: dict, bound: dict, room: int, lat: int, grain: int) -> None:
    """The budget bound: shrinks the free sizes, in the Note's order, until the transients fit
    `room` (or every free size is at its least)."""
    def fits() -> bool:
        return facts.transients(values) <= room

    def shrink(key: str, least: int, step: int) -> None:
        top = values[key]
        if fits() or key not in bound or least >= top:
            return

        def fit_at(x: int) -> bool:
            values[key] = least + x
            return fits()
        values[key] = least + planner._largest(fit_at, top - least, step)
        bound[key] = "budget"

    shrink(BUCKET, max(lat, grain), grain)
    shrink(BUCKET, grain, grain)
    shrink(PREFETCH, 0, ALIGN)


def _why(key: str, bound: str, facts: SizeFacts, values: dict, lat: int) -> str:
    g = facts.gather
    if key == SUB_GROUP:
        return (f"the smallest whose every file request ({facts.stream_element} B per element) "
                f"is {mib(facts.request_bytes)}: no smaller than the disk probe's requests "
                f"({mib(bandwidths.DISK_REQUEST_BYTES)}) and the aio queue (block_size x "
                f"queue_depth x threads); each of the stream's buffer sets costs host RAM that "
                f"max_in_cpu could keep")
    if bound == "budget":
        return (f"as large as the budget allows: the reductions in flight and the gathered "
                f"weights, {mib(facts.transients(values))}, fit the room left")
    if key == BUCKET and bound == "latency":
        return (f"latency <= {LATENCY_SHARE:.0%} of a collective: 19 x alpha x beta = "
                f"{mib(latency_floor_bytes(g))} ({lat:,} elements), more than the largest unit's "
                f"gradient ({max(facts.grad_numels):,})")
    if key == BUCKET:
        return (f"the largest unit's gradient, so each unit reduces in one collective (the "
                f"latency is {LATENCY_SHARE:.0%} of a collective from 19 x alpha x beta = "
                f"{lat:,} elements)")
    if bound == "max_live":
        return (f"stage3_max_live_parameters {facts.max_live:,} less the unit in use: the largest "
                f"unit ({max(facts.gathered_numels):,}) cannot be gathered ahead whole")
    return ("the largest unit gathered per use: the next unit is gathered while the current "
            "one computes")


# ------------------------------------------------------------------------------ at initialize
def facts_of(inputs, model: torch.nn.Module, gather: AllGatherRate | None) -> SizeFacts:
    """The engine's own figures for the rules: its units, dtypes and byte rules."""
    cfg = inputs.cfg
    zero = cfg.zero_optimization
    layouts = planner._layouts(inputs, PlacementPolicy())
    element = torch.empty(0, dtype=inputs.dtype).element_size()
    units = [(name, module, lay.numel, lay.padded_numel)
             for (name, module, *_), lay in zip(inputs.groups, layouts)]

    def reduction_bytes(bucket: int) -> int:
        return reduce_buffer_bytes(layouts, inputs.policy, inputs.dtype, inputs.reduce,
                                   zero.model_copy(update={BUCKET: bucket}), inputs.world)

    def gathered_bytes(prefetch: int) -> int:
        if not inputs.policy.shard_weights:
            return 0
        return element * gathered_peak_numel(units, [u[1] for u in units], model,
                                             zero.model_copy(update={PREFETCH: prefetch}))

    stream = None
    if "nvme" in planner.freedom(cfg).optimizers:
        p = bf16_state.with_state_dtypes(cfg, PlacementPolicy(), inputs.optimizer)
        stream = min(torch.empty(0, dtype=d).element_size() for d in (p.master_dtype, p.state_dtype))
    aio = cfg.aio.engine_config()
    given = {k for k in KEYS if k in zero.model_fields_set}
    return SizeFacts(
        inputs.world, gather, tuple(lay.padded_numel for lay in layouts if lay.parts),
        tuple(lay.padded_numel for (_, module, numel, _), lay in zip(units, layouts)
              if inputs.policy.shard_weights and module is not model
              and numel > zero.stage3_param_persistence_threshold),
        torch.empty(0, dtype=inputs.reduce).element_size(),
        zero.stage3_max_live_parameters, {k: getattr(zero, k) for k in KEYS},
        frozenset(KEYS) - given, stream,
        max(bandwidths.DISK_REQUEST_BYTES, aio.block_size * aio.queue_depth * aio.thread_count),
        reduction_bytes, gathered_bytes)


def _with(cfg, keys: dict):
    if not keys:
        return cfg
    zero = cfg.zero_optimization
    return cfg.model_copy(update={"zero_optimization": zero.model_copy(update=keys)})


def _placed(inputs, base, facts: SizeFacts, sizes: Sizes, bw):
    """The placement planned with `sizes` in the config the candidates read."""
    inputs.cfg = _with(base, sizes.chosen)
    inputs.transient_bytes = sizes.transient_bytes
    inputs.gathered_bytes = sizes.gathered_bytes
    plan = planner.choose(inputs, bw)
    if SUB_GROUP in sizes.chosen and plan.chosen.choice.optimizer != "nvme":
        del sizes.chosen[SUB_GROUP], sizes.bound[SUB_GROUP]  # it means nothing there
        sizes.values[SUB_GROUP] = facts.configured[SUB_GROUP]
        sizes.why[SUB_GROUP] = "not chosen: the optimizer does not stream from NVMe"
        plan.config = _with(plan.config, {SUB_GROUP: facts.configured[SUB_GROUP]})
    plan.sizes = sizes
    return plan


def _room(considered: list, transient: int, cuda: bool) -> int | None:
    """The most transient bytes with which some placement fits, from a refused search: the
    least any candidate is over in the checks that hold the transients (and in no other);
    None where none is over only there."""
    holding = {"device"} | (set() if cuda else {"host"})
    lacks = [max(p.over.values()) for p in considered
             if not p.invalid and p.over and set(p.over) <= holding]
    return transient - min(lacks) if lacks else None


def plan_with_sizes(inputs, model: torch.nn.Module, gather: AllGatherRate | None, bw):
    """initialize's planning: the sizes, the transients they cost, the placement; where no
    placement fits, the sizes shrink to the room the closest one leaves (the budget bound)."""
    base, facts = inputs.cfg, facts_of(inputs, model, gather)
    sizes = choose_sizes(facts)
    try:
        return _placed(inputs, base, facts, sizes, bw)
    except planner.PlacementBudgetError as e:
        room = _room(e.considered, sizes.transient_bytes, inputs.cuda)
        smaller = choose_sizes(facts, room) if room is not None else sizes
        if smaller.values == sizes.values:
            raise
        return _placed(inputs, base, facts, smaller, bw)

