"""Budgets (config "memory") enforced: at start-up against the plan, at every allocation by the
ledger, and on the process's RSS through each step (its peak, with the phase), with unaccounted
memory reported once.
The byte counts the tests expect come from the model's parameters, not from the ledger."""
from __future__ import annotations

import gc
import logging
import threading
import time

import pytest
import torch

import zerokit
from harness import run_world
from reference import tiny_gpt
from zerokit.engine.host_budget import HostMemoryError, RssWatch
from zerokit.tiers.ledger import BudgetExceededError


def _engine(memory: dict, stage: int = 3, **zero):
    torch.set_num_threads(1)
    engine, *_ = zerokit.initialize(model=tiny_gpt(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "memory": memory, "zero_optimization": {"stage": stage, **zero}})
    return engine


def _step(engine) -> None:
    x = torch.randint(0, 50, (2, 16))
    engine.backward(engine(x, x))
    engine.step()


def test_a_host_budget_below_the_offload_plan_is_refused_at_start() -> None:
    with pytest.raises(HostMemoryError, match=r"memory\.host"):
        _engine({"host": "64KiB"}, stage=2, offload_optimizer={"device": "cpu"})


def _past_the_device_budget(rank: int, world: int) -> tuple[str, int, int]:
    """Stage 3, fp32: initialize holds each unit's shard and its fp32 gradient shard (the master
    is the shard), with room for a unit's padding and no more. With two ranks the first forward
    gathers a unit, a transient of its padded size, and crosses the budget there. With one the
    shard is the weights ([Note: one rank's shard is its weights]): nothing is gathered, and the
    first backward's scratch buffer for the reduction, of a unit's padded size, crosses it."""
    model = tiny_gpt()
    held = sum(p.numel() for p in model.parameters()) * (4 + 4) // world  # shard + gradient
    budget = held + 2048  # with each unit's padding (< 32 elements) it fits; a unit's buffer not
    assert model.transformer.wte.weight.numel() * 4 > 2048
    # placement by hand (the planner would move state off the device to fit the budget:
    # tests/unit/test_planner.py), so that the ledger's own check is what fails
    engine = _engine({"device": budget}, stage=3, stage3_param_persistence_threshold=0,
                     stage3_max_reuse_distance=0, offload_param={"device": "none"},
                     offload_optimizer={"device": "none"})
    with pytest.raises(BudgetExceededError) as err:
        _step(engine)
    return str(err.value), engine.ledger.bytes("device"), budget


@pytest.mark.parametrize("world, crossing", [(1, "scratch buffers buffer"),
                                             (2, "transient weights buffer")])
def test_an_allocation_past_the_device_budget_fails_with_the_breakdown(world, crossing) -> None:
    results = ([_past_the_device_budget(0, 1)] if world == 1
               else run_world(_past_the_device_budget, world))
    for text, held, budget in results:
        assert "device budget" in text and crossing in text and "weights" in text, text
        assert held <= budget  # the crossing allocation was not counted


def test_rss_past_the_host_budget_fails_after_the_step() -> None:
    engine = _engine({"host": "1MiB"}, stage=0)  # nothing planned on the host: start-up passes
    with pytest.raises(BudgetExceededError, match=r"RSS, .* at its peak \(.*\), is past the host budget of 1\.0 MiB"):
        _step(engine)


class _SpikeInForward(torch.nn.Module):
    """tiny_gpt whose forward holds `spike` bytes of its own for a while and frees them before
    it returns: a peak inside the step that a sample after the step cannot see."""

    def __init__(self, spike: int):
        super().__init__()
        self.gpt, self.spike = tiny_gpt(), spike

    def forward(self, x, y):
        if self.spike:
            held = torch.ones(self.spike // 4)  # pages touched: resident
            time.sleep(4 * RssWatch.INTERVAL_S)
            del held
        return self.gpt(x, y)


def test_an_rss_peak_inside_the_step_past_the_host_budget_fails_naming_its_phase() -> None:
    torch.set_num_threads(1)
    model = _SpikeInForward(0)
    engine, *_ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 0}})
    try:
        _step(engine)
        _step(engine)
        # a budget 128 MiB above what the process holds now, and a 384 MiB spike in forward
        engine.ledger.set_budget("host", RssWatch.rss() + 128 * 2**20, "test")
        _step(engine)  # no spike: within the budget
        model.spike = 384 * 2**20
        with pytest.raises(BudgetExceededError, match=r"RSS, .* at its peak \(forward[^)]*\), is past the host budget"):
            _step(engine)
        assert RssWatch.rss() < engine.ledger.budget("host")  # back under it when the step ended
    finally:
        engine.destroy()


def _ends(thread: threading.Thread) -> bool:
    thread.join(timeout=5)
    return not thread.is_alive()


def test_the_rss_sampler_stops_when_the_engine_is_destroyed_or_dropped() -> None:
    engine = _engine({}, stage=2)
    thread = engine.rss_watch._thread
    assert thread.name == "zerokit-rss-watch" and thread.is_alive()
    engine.destroy()
    assert not thread.is_alive()  # destroy joined it
    engine = _engine({}, stage=3)
    _step(engine)
    thread = engine.rss_watch._thread
    del engine  # dropped without destroy: collected, its attachment stops the thread
    gc.collect()
    assert _ends(thread)


def test_injected_drift_is_reported_once() -> None:
    engine = _engine({"rss_margin": "32MiB"}, stage=0)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("zerokit").addHandler(handler)
    try:
        _step(engine)
        assert not [r for r in records if "unaccounted" in r.getMessage()]
        leak = torch.ones(96 * 2**20 // 4)  # 96 MiB the ledger never hears of, pages touched
        _step(engine)
        _step(engine)
        reports = [r.getMessage() for r in records if "unaccounted" in r.getMessage()]
        assert len(reports) == 1 and "rss_margin" in reports[0], reports
    finally:
        logging.getLogger("zerokit").removeHandler(handler)
        engine.destroy()
    del leak
