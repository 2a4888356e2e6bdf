"""The size keys the planner chooses beside the placement (engine/size_plan.py, [Note: choosing
the sizes]): each bound acting on injected facts (the all-gather's latency and bandwidth, the
units, the byte rules, the budget's room), a key the config sets kept, world 1 choosing no
collective sizes; then through the planner on a small GPT's own units: the chosen keys reach the
config, its DeepSpeed dict and the explanation, a budget no placement fits with the sizes at
their best shrinks them, and the chosen sub_group_size is what the max_in_cpu search counts.
The all-gather's line fit is checked here; the probe itself on 2 gloo ranks in
tests/dist/test_placement_planner.py."""
from __future__ import annotations

import dataclasses

import pytest

from reference import tiny_gpt
from test_planner import BW, MODEL, SMALL, _cfg, _inputs, _host_need
from zerokit.engine import bandwidths, planner, size_plan
from zerokit.engine.bandwidths import AllGatherRate, fit_latency_bandwidth
from zerokit.engine.planner import PlacementBudgetError, choose
from zerokit.engine.size_plan import BUCKET, KEYS, PREFETCH, SUB_GROUP, SizeFacts, choose_sizes

DEFAULTS = {BUCKET: 500_000_000, PREFETCH: 50_000_000, SUB_GROUP: 1_000_000_000}
UNIT = 1 << 20  # elements of each of 8 units (a multiple of 2 ranks x 32)


def _facts(alpha: float = 1e-5, beta: float = 1e9, *, units=(UNIT,) * 8, world: int = 2,
           free=KEYS, max_live: int = 1_000_000_000, stream: int | None = None, **over) -> SizeFacts:
    """fp32 gradients and bf16 gathers; the transients as the byte rules count them here: the
    reductions in flight, 2 buckets beside the newest unit's (all of them where they add up to
    less), and the unit in use plus the prefetch window gathered."""
    def reductions(bucket: int) -> int:
        return 4 * min(sum(units), 2 * bucket + max(units))

    def gathered(prefetch: int) -> int:
        return 2 * (max(units) + prefetch)

    return SizeFacts(world, AllGatherRate(alpha, beta) if world > 1 else None, tuple(units),
                     tuple(units), 4, max_live, dict(DEFAULTS), frozenset(free), stream,
                     **{"reduction_bytes": reductions, "gathered_bytes": gathered, **over})


def test_a_fast_link_with_large_units_reduces_each_unit_in_one_collective():
    """19 x alpha x beta = 190 KB: a unit's 4 MiB gradient is past the latency floor."""
    s = choose_sizes(_facts(alpha=1e-5, beta=1e9))
    assert s.chosen[BUCKET] == UNIT and s.bound[BUCKET] == "unit"
    assert "each unit reduces in one collective" in s.explain()
    # one unit ahead, the next, whichever it is
    assert s.chosen[PREFETCH] == UNIT and s.bound[PREFETCH] == "unit"
    assert s.room is None and s.transient_bytes == 4 * (3 * UNIT) + 2 * (2 * UNIT)


def test_a_high_latency_link_raises_the_bucket_to_the_latency_floor():
    """alpha 1 ms at 10 GB/s: below 190 MB a collective spends more than 5% waiting."""
    alpha, beta = 1e-3, 10e9
    s = choose_sizes(_facts(alpha, beta))
    b = s.chosen[BUCKET]
    assert s.bound[BUCKET] == "latency" and b > UNIT and b % (2 * 32) == 0
    seconds = alpha + 4 * b / beta
    assert alpha / seconds <= 0.05  # the rule's promise
    assert alpha / (alpha + 4 * (b - 64) / beta) > 0.0499  # and no larger than it needs
    assert f"{b:,} elements: latency <= 5% of a collective" in s.explain()


def test_the_budget_takes_the_bucket_down_first_then_the_prefetch():
    alpha, beta = 1e-3, 10e9  # latency floor: 47.5M elements, far above a unit
    best = choose_sizes(_facts(alpha, beta))
    floor = best.chosen[BUCKET]
    full = best.transient_bytes
    # room for the prefetch and one unit's reductions in flight beside 2 buckets of 1/4 unit
    room = 4 * (UNIT + UNIT // 2) + 2 * (2 * UNIT)
    s = choose_sizes(_facts(alpha, beta), room)
    assert room < full and s.transient_bytes <= room
    assert s.bound[BUCKET] == "budget" and s.chosen[BUCKET] < floor
    assert s.chosen[PREFETCH] == UNIT and s.bound[PREFETCH] == "unit"  # kept whole
    assert s.chosen[BUCKET] >= UNIT // 4 - 64  # the largest bucket that fits (64: the grain)
    assert "as large as the budget allows" in s.explain() and "the budget leaves" in s.explain()
    # tighter than the least bucket with the prefetch: the prefetch gives way
    room = 4 * (UNIT + 128) + 2 * (UNIT + UNIT // 2)
    s = choose_sizes(_facts(alpha, beta), room)
    assert s.chosen[BUCKET] == 64 and s.bound[PREFETCH] == "budget"
    assert 0 < s.chosen[PREFETCH] < UNIT and s.transient_bytes <= room
    # a room no sizes reach: everything at its least, the planner's refusal then says the rest
    s = choose_sizes(_facts(alpha, beta), 1)
    assert (s.chosen[BUCKET], s.chosen[PREFETCH]) == (64, 0)
    # with a short latency floor the bucket stops there before going below it
    s = choose_sizes(_facts(1e-6, 1e9), 4 * (UNIT + 2 * 8192) + 2 * (2 * UNIT))
    assert s.chosen[BUCKET] == 8192 and s.chosen[PREFETCH] == UNIT  # 19 kB / 4 = 4750 -> 8192 fits


def test_keys_the_config_sets_are_kept_whatever_the_facts_and_budget():
    facts = _facts(1e-3, 10e9, free=(SUB_GROUP,), stream=4)
    s = choose_sizes(facts, 1)
    assert BUCKET not in s.chosen and PREFETCH not in s.chosen
    assert s.values[BUCKET] == DEFAULTS[BUCKET] and s.values[PREFETCH] == DEFAULTS[PREFETCH]
    assert "reduce_bucket_size 500,000,000 elements: set in the config, kept" in s.explain()
    assert s.chosen == {SUB_GROUP: (4 << 20) // 4}


def test_the_prefetch_stays_within_max_live_parameters():
    s = choose_sizes(_facts(max_live=UNIT + UNIT // 2))
    assert s.chosen[PREFETCH] == UNIT // 2 and s.bound[PREFETCH] == "max_live"
    assert choose_sizes(_facts(max_live=UNIT)).chosen[PREFETCH] == 0
    # units of different sizes: the largest, so any next unit fits the window
    s = choose_sizes(_facts(units=(64, UNIT, 4096)))
    assert s.chosen[PREFETCH] == UNIT


def test_the_sub_group_is_the_smallest_the_disk_requests_allow():
    """Smaller sub-groups free RAM for max_in_cpu; each file request stays as large as what the
    disk rate was measured with and what fills the aio queue."""
    assert choose_sizes(_facts(stream=4)).chosen[SUB_GROUP] == (4 << 20) // 4
    assert choose_sizes(_facts(stream=2)).chosen[SUB_GROUP] == (4 << 20) // 2  # bf16 files
    s = choose_sizes(_facts(stream=4, request_bytes=8 << 20))
    assert s.chosen[SUB_GROUP] == (8 << 20) // 4 and s.bound[SUB_GROUP] == "disk"
    assert SUB_GROUP not in choose_sizes(_facts(stream=None)).chosen  # no NVMe stream possible


def test_world_1_measures_nothing_and_sizes_no_collectives():
    s = choose_sizes(_facts(world=1, stream=4))
    assert s.chosen == {SUB_GROUP: 1 << 20}
    assert s.values[BUCKET] == DEFAULTS[BUCKET] and s.values[PREFETCH] == DEFAULTS[PREFETCH]
    assert s.explain().startswith("sizes: world 1: no all-gather measured and no collectives to size")


def test_the_line_through_two_timings():
    alpha, beta = fit_latency_bandwidth((1 << 20, 64 << 20), (1e-4 + (1 << 20) / 2e9, 1e-4 + (64 << 20) / 2e9))
    assert alpha == pytest.approx(1e-4) and beta == pytest.approx(2e9)
    assert fit_latency_bandwidth((1000, 2000), (2e-3, 1e-3)) == (0.0, 2e6)  # noise: no latency
    assert fit_latency_bandwidth((1000, 2000), (1e-6, 1e-3))[0] == 0.0      # never negative
    with pytest.raises(ValueError, match="beta must be a positive number"):
        AllGatherRate(1e-5, 0)


# ------------------------------------------------------------------------------ through the planner
GATHER = AllGatherRate(1e-5, 1e9)  # floor 47,500 elements fp32: a small GPT's units are above


def _stage3(**zero):
    # units above the persistence threshold, so they are gathered per use (and prefetched)
    return _cfg(stage=3, zero={"stage3_param_persistence_threshold": 0, **zero}, nvme=None)


def _units(inputs, plan) -> list[int]:
    return [lay.padded_numel for lay in planner._layouts(inputs, planner._placement(inputs, plan.config))]


def test_the_chosen_sizes_reach_the_config_its_dict_and_the_explanation():
    cfg = _stage3(stage3_prefetch_bucket_size=1000)  # one key set by hand
    model = tiny_gpt(cfg=MODEL)
    inputs = _inputs(cfg, 1 << 30, world=2, model=model)
    plan = size_plan.plan_with_sizes(inputs, model, GATHER, BW)
    units = _units(inputs, plan)
    z = plan.config.zero_optimization
    assert plan.sizes.chosen == {BUCKET: max(units)} and z.reduce_bucket_size == max(units)
    assert z.stage3_prefetch_bucket_size == 1000 and z.sub_group_size == DEFAULTS[SUB_GROUP]
    raw = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1000}}
    plan.shown_in(raw)
    assert raw["zero_optimization"][BUCKET] == max(units)
    assert raw["zero_optimization"][PREFETCH] == 1000
    text = plan.explain()
    assert "sizes: all-gather alpha 10 us, beta 1.00 GB/s" in text
    assert f"reduce_bucket_size {max(units):,} elements: the largest unit's gradient" in text
    assert "stage3_prefetch_bucket_size 1,000 elements: set in the config, kept" in text
    # world 1: no collective sizes chosen (and no disk here: no sub-group either)
    plan = size_plan.plan_with_sizes(_inputs(_stage3(), 1 << 30, model=model), model, None, BW)
    assert plan.sizes.chosen == {} and plan.config.zero_optimization.reduce_bucket_size == DEFAULTS[BUCKET]


def test_the_prefetch_is_the_largest_block_not_the_root_unit():
    """The root's leftovers (here a large embedding) are gathered for the whole step, never
    prefetched: the window is the largest unit gathered per use."""
    from zerokit.models import GPTConfig

    model = tiny_gpt(cfg=GPTConfig(vocab_size=4096, block_size=16, n_layer=4, n_head=4, n_embd=64, bias=False))
    inputs = _inputs(_stage3(), 1 << 30, world=2, model=model)
    plan = size_plan.plan_with_sizes(inputs, model, GATHER, BW)
    units = _units(inputs, plan)
    assert units[-1] == max(units) > max(units[:-1])  # the last unit: the root's
    assert plan.sizes.chosen[PREFETCH] == max(units[:-1])
    assert plan.sizes.chosen[BUCKET] == max(units)  # its gradient is reduced like any other


def test_a_budget_that_fits_no_placement_with_the_best_sizes_shrinks_them():
    """No disk: the placements are fixed sums, so a host budget a little under the least of
    them with the best sizes fits once the sizes give up that much (on a CPU device the
    transients are host RAM)."""
    cfg = _stage3()
    model = tiny_gpt(cfg=MODEL)
    slow = AllGatherRate(1e-3, 10e9)  # a latency floor above the whole model: every unit in flight

    def inputs(host, **kw):
        return _inputs(cfg, host, world=2, model=model, **kw)

    facts = size_plan.facts_of(inputs(1 << 30), model, slow)
    best, least = choose_sizes(facts), choose_sizes(facts, 1)
    assert best.transient_bytes > least.transient_bytes + (64 << 10)
    with_best = choose(inputs(1 << 30, transients=best.transient_bytes), BW)
    fewest = min(_host_need(p) for p in with_best.considered)
    budget = fewest - (best.transient_bytes - least.transient_bytes) // 2
    with pytest.raises(PlacementBudgetError):  # the sizes at their best: nothing fits
        choose(inputs(budget, transients=best.transient_bytes), BW)
    plan = size_plan.plan_with_sizes(inputs(budget), model, slow, BW)
    s = plan.sizes
    assert s.bound[BUCKET] == "budget" and s.chosen[BUCKET] < best.chosen[BUCKET], s.explain()
    assert plan.chosen.fits and _host_need(plan.chosen) <= budget
    assert s.transient_bytes <= s.room == budget - (fewest - best.transient_bytes)
    # the bucket gave way first: the prefetch holds one unit still
    assert s.chosen[PREFETCH] == best.chosen[PREFETCH]
    assert "the budget leaves" in plan.explain()
    # a budget the least sizes cannot reach is refused as before
    with pytest.raises(PlacementBudgetError):
        size_plan.plan_with_sizes(inputs(fewest - best.transient_bytes), model, slow, BW)


def test_the_chosen_sub_group_is_what_the_max_in_cpu_search_counts(monkeypatch):
    """Where the optimizer streams from NVMe, the chosen sub_group_size is in the config every
    candidate is predicted with: the plan is the one the same key set by hand gives, with more
    room for a budget the configured default's buffer sets do not fit."""
    monkeypatch.setattr(bandwidths, "DISK_REQUEST_BYTES", 4096)  # a sub-group of 1,024 elements
    aio = {"aio": {"block_size": 4096, "queue_depth": 1, "thread_count": 1}}
    cfg = _cfg(stage=2, **aio)
    model = tiny_gpt(cfg=SMALL)

    def inputs(config, host, **kw):
        return _inputs(config, host, process=50 << 20, model=model, **kw)

    plan = size_plan.plan_with_sizes(inputs(cfg, 1 << 30), model, None, BW)
    transients = plan.sizes.transient_bytes  # the reductions' buffers: no size of them chosen
    in_ram = min(_host_need(p) for p in plan.considered if p.fits and not p.tier(planner.TierName.NVME))
    budget = in_ram - (256 << 10)
    # a placement that does not stream leaves the key as configured
    assert plan.chosen.choice.optimizer != "nvme" and plan.sizes.chosen == {}
    assert plan.config.zero_optimization.sub_group_size == DEFAULTS[SUB_GROUP]
    assert "sub_group_size 1,000,000,000 elements: not chosen" in plan.explain()
    plan = size_plan.plan_with_sizes(inputs(cfg, budget), model, None, BW)
    assert plan.chosen.choice.optimizer == "nvme" and plan.sizes.chosen == {SUB_GROUP: 1024}
    assert plan.config.zero_optimization.sub_group_size == 1024
    by_hand = choose(inputs(_cfg(stage=2, zero={"sub_group_size": 1024}, **aio), budget,
                            transients=transients), BW)
    assert dataclasses.astuple(plan.chosen.choice) == dataclasses.astuple(by_hand.chosen.choice)
    assert plan.chosen.bytes == by_hand.chosen.bytes
    # with the configured sub-group (a whole part per buffer set) nothing fits this budget
    with pytest.raises(PlacementBudgetError):
        choose(inputs(cfg, budget, transients=transients), BW)


def test_a_host_budget_without_a_gpu_counts_the_transients_in_ram():
    """What `_room` reads: on a CPU device the host check holds the transients."""
    inputs = _inputs(_stage3(), 1 << 30, world=2, transients=12345)
    p = planner.predict(inputs, planner.Choice("cpu", 0, 5, "cpu", 1.0, 0, 4, False), BW)
    assert p.checks["host"][3]["device transients (gathered weights, reductions)"] == 12345
