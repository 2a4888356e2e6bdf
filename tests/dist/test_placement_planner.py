"""Budgets in, placement out, end to end (engine/planner.py): a tiny GPT at stage 3 on 1 and 2
gloo ranks with a host budget and no placement key (the offload sections say only where the disk
is) trains as the one-process torch reference does, and the ledger's peak host bytes and the
process's RSS stay under the budget. A roomy budget puts nothing on NVMe; a budget below what the
states need in RAM puts part of them on NVMe; an impossible one is refused at initialize on every
rank with the smallest budget that would work. Bandwidths are injected (the probe is replaced),
except the all-gather's: at 2 ranks the real probe runs on gloo, every rank ends with the same
figures, they are cached, and the bucket and prefetch sizes chosen from them (engine/size_plan.py)
are what the engine runs, training as the reference does."""
from __future__ import annotations

import pytest
import torch

from harness import run_world
from reference import engine_train, global_batches, reference_train, tiny_gpt
from zerokit.models import GPTConfig

STEPS, MICRO, LR = 3, 2, 1e-3
# Larger than the reference's tiny GPT, so that the states (16 B per element, 53 MB at one rank)
# stand out of the RSS's noise, and still a second per step on one core.
MODEL = GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=4, n_embd=256, bias=False)
# memory.rss_margin: what the planner leaves for what it does not model. Measured here: RSS grows
# ~95 MiB during initialize beyond what the ledger counts (threads, the I/O engine, lazy imports)
# and ~45 MiB in the first step (activations, autograd, the step's transients).
MARGIN = 160 << 20


def _make():
    return tiny_gpt(cfg=MODEL)


def _states_bytes() -> int:
    return sum(p.numel() for p in _make().parameters()) * 16  # weights, gradient, two moments


def _config(path: str, host: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
            "memory": {"host": host, "rss_margin": MARGIN},
            "zero_optimization": {"stage": 3, "sub_group_size": 5000,
                                  "offload_optimizer": {"nvme_path": path},
                                  "offload_param": {"nvme_path": path}},
            "aio": {"block_size": 65536, "queue_depth": 4, "thread_count": 2}}


def _train(rank, world, path, headroom, cache, again=False):
    """headroom: the budget is this rank's RSS now plus this many bytes. again: initialize a
    second time after training (the cached all-gather rate)."""
    import logging
    import os

    import psutil

    import zerokit
    from zerokit.engine import bandwidths, planner_at_init

    plans = []  # what initialize planned, sizes included
    planned = planner_at_init.plan_at_initialize
    planner_at_init.plan_at_initialize = lambda *a: plans.append(planned(*a)) or plans[-1]

    os.environ["ZEROKIT_CACHE_DIR"] = cache
    bandwidths.PROBE = lambda p, d: bandwidths.Bandwidths(10e9, 2e9, 1e9, 400e6, 100e6, "", "injected")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("zerokit").addHandler(handler)
    logging.getLogger("zerokit").setLevel(logging.INFO)
    model = _make()
    budget = psutil.Process().memory_info().rss + headroom
    budget = budget if world == 1 else _max(budget)  # one config on every rank, as in a real run
    try:
        engine, *_ = zerokit.initialize(model=model, config=_config(path, budget))
    except MemoryError as e:
        return {"error": f"{type(e).__name__}: {e}", "budget": budget}
    losses = engine_train(engine, global_batches(STEPS, MICRO * world), rank, world)
    out = {"losses": losses, "weights": engine.consolidated_fp32_state_dict(), "budget": budget,
           "host_peak": engine.ledger.bytes(tier="host", peak=True),
           "nvme": engine.ledger.bytes(tier="nvme", peak=True),
           "rss": psutil.Process().memory_info().rss,
           "placement": engine.placement.describe() + " | " + engine.placement.describe_params(),
           "log": [r for r in records if r.startswith("memory planner")],
           "sizes": _sizes(plans[-1], engine)}
    engine.destroy()
    if again:  # the process grew while training: the same headroom over its RSS now
        budget = _max(psutil.Process().memory_info().rss + headroom)
        engine, *_ = zerokit.initialize(model=_make(), config=_config(path, budget))
        out["again"] = _sizes(plans[-1], engine)
        engine.destroy()
    return out


def _sizes(plan, engine) -> dict:
    """The chosen sizes and the all-gather figures as planned, and as the engine runs them."""
    zero = engine.config.zero_optimization
    gather = plan.sizes.gather
    return {"chosen": plan.sizes.chosen, "bound": plan.sizes.bound,
            "gather": (gather.alpha, gather.beta, gather.source) if gather else None,
            "config": (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size, zero.sub_group_size),
            "shown": {k: engine.config["zero_optimization"].get(k) for k in plan.sizes.chosen},
            "units": {u.bucket_numel for u in engine.units},
            "prefetch": engine.scheduler.prefetch_numel,
            "largest_unit": max(u.padded_numel for u in engine.units)}


def _max(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())


def _check_parity(results, world):
    ref_losses, ref = reference_train(_make, lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.1),
                                      global_batches(STEPS, MICRO * world))
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for name, w in ref.items():
            # Adam divides by the gradient's size: where it is near zero, the sum's order (two
            # ranks vs one process) moves an element by a fraction of a step (lr)
            torch.testing.assert_close(r["weights"][name], w, rtol=1e-5, atol=LR * 1e-2,
                                       msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("world", [1, 2])
def test_a_roomy_host_budget_trains_with_nothing_on_nvme(tmp_path, world):
    results = run_world(_train, world, str(tmp_path), 256 << 20, str(tmp_path / "cache"))
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["nvme"] == 0, r["placement"]
        assert r["host_peak"] <= r["budget"] and r["rss"] <= r["budget"]
    log = results[0]["log"]
    assert log and "chosen:" in log[0] and "=>" in log[0], log
    assert not results[1]["log"] if world == 2 else True  # rank 0 explains
    _check_parity(results, world)


def test_two_ranks_probe_the_all_gather_alike_cache_it_and_run_the_sizes_chosen(tmp_path):
    import json

    results = run_world(_train, 2, str(tmp_path), 256 << 20, str(tmp_path / "cache"), True)
    first = [r["sizes"] for r in results]
    for r in results:
        assert "error" not in r, r.get("error")
    alpha, beta, source = first[0]["gather"]
    assert source == "measured" and beta > 0 and alpha >= 0
    assert first[1]["gather"] == first[0]["gather"]  # the same figures on both ranks
    assert first[1]["chosen"] == first[0]["chosen"]
    for s in first:
        chosen = s["chosen"]
        # sub_group_size is set in the config (kept); the bucket and the prefetch are chosen
        assert set(chosen) == {"reduce_bucket_size", "stage3_prefetch_bucket_size"}, s
        assert chosen["reduce_bucket_size"] >= s["largest_unit"]  # one unit, one collective
        assert s["config"] == (chosen["reduce_bucket_size"], chosen["stage3_prefetch_bucket_size"], 5000)
        assert s["shown"] == chosen  # engine.config's DeepSpeed dict
        assert s["units"] == {chosen["reduce_bucket_size"]}
        assert s["prefetch"] == chosen["stage3_prefetch_bucket_size"] > 0
    log = results[0]["log"][0]
    assert f"reduce_bucket_size {first[0]['chosen']['reduce_bucket_size']:,} elements" in log, log
    assert "sizes: all-gather alpha" in log
    # cached by rank 0 under this world and backend, read back by the second initialize
    entries = json.loads((tmp_path / "cache" / "bandwidths.json").read_text())
    (key,) = [k for k in entries if "|all-gather|" in k]
    assert key.endswith("|all-gather|world 2|gloo") and entries[key]["measured_at"]
    again = [r["again"] for r in results]
    assert again[0]["gather"][2].startswith("cached in") and again[1]["gather"][2] == "rank 0's cache"
    assert again[0]["gather"][:2] == again[1]["gather"][:2] == (alpha, beta)
    assert again[0]["chosen"] == first[0]["chosen"]
    _check_parity(results, 2)


@pytest.mark.parametrize("world", [1, 2])
def test_a_tight_host_budget_puts_part_of_the_states_on_nvme_and_trains_the_same(tmp_path, world):
    # Beyond the process and the margin, the budget holds the model's fp32 weights (in RAM now,
    # replaced by the units) and the states' 16 B per element / world again: 20 B per element
    # at world 2 (per element of the rank's shard). In RAM, the states (16 B) and the step's
    # transients (stage 3's gathered units and the reductions' buffers, 4 B each at most) need
    # more. One rank with its shards in RAM gathers nothing ([Note: one rank's shard is its
    # weights]), so there the budget is 4 B per element less: 16 B. With the weights and the
    # optimizer on NVMe the transients, the read-ahead and some of the optimizer fit.
    headroom = MARGIN + _states_bytes() // world - (_states_bytes() // 4 if world == 1 else 0)
    results = run_world(_train, world, str(tmp_path), headroom, str(tmp_path / "cache"))
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["nvme"] > 0, r["placement"]
        assert r["host_peak"] <= r["budget"], r
        assert r["rss"] <= r["budget"], r
    _check_parity(results, world)


def test_an_impossible_host_budget_is_refused_on_every_rank(tmp_path):
    results = run_world(_train, 2, str(tmp_path), -(64 << 20), str(tmp_path / "cache"))
    for r in results:
        assert r.get("error", "").startswith("PlacementBudgetError: no placement fits"), r
        assert "The smallest budget that would work: memory.host" in r["error"], r["error"]
