"""engine/health.py: a rank's position for failure reports, at every stage.

describe_position feeds the text a CollectiveError ends with ("this rank was at ..."); the
collective error path swallows any exception it raises (a description must never hide the failure
it describes), so a describe_position that breaks at some stage silently drops the position from
every report there. Each stage's schedule is asked for real, in the middle of a forward.
"""
from __future__ import annotations

import re

import pytest

from harness import run_world
from reference import global_batches, tiny_gpt
from fast_tier import slow_except


def _positions_mid_forward(rank: int, world: int, stage: int) -> list[str]:
    """describe_position read inside the last block's forward, at steps 0 and 1."""
    import zerokit
    from zerokit.engine.health import describe_position

    model = tiny_gpt()
    engine, _, _, _ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    seen: list[str] = []
    model.transformer.h[-1].register_forward_pre_hook(lambda m, a: seen.append(describe_position(engine)))
    for x, y in global_batches(2, 2):
        engine.backward(engine(x, y))
        engine.step()
    return seen


@pytest.mark.parametrize("stage", slow_except([0, 1, 2, 3], fast=[0, 3]))
def test_describe_position_at_every_stage(stage: int) -> None:
    (first, second), = run_world(_positions_mid_forward, 1, stage)
    # Counted by hand: the engine's counters before each step, the phase the forward sets.
    assert first.startswith("global step 0, forward (micro-step 0)"), first
    assert second.startswith("global step 1, forward (micro-step 1)"), second
    if stage < 3:
        # Weights are resident: no order of uses is kept, so nothing more is said.
        assert first == "global step 0, forward (micro-step 0)", first
        assert "stage-3" not in second, second
        return
    # tiny_gpt's units: transformer.h.0, transformer.h.1, then the root's leftovers (embeddings,
    # head). The root is used first (its forward starts the iteration), then h.0, then h.1 (the
    # engine's pre-hook on h.1 was registered before the test's, so h.1 is already in use).
    for text in (first, second):
        found = re.search(r", stage-3 use (\d+) of this iteration, last unit '([\w.]+)'", text)
        assert found, text
        assert found.groups() == ("3", "transformer.h.1"), text
    assert "(the recorded order has 0 uses)" in first, first  # step 0 is still recording
    assert re.search(r"\(the recorded order has \d+ uses\)", second), second
    assert "(the recorded order has 0 uses)" not in second, second
