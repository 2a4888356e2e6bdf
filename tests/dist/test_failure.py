"""A rank that dies mid-step makes the others stop with a message naming it, instead of hanging."""
from __future__ import annotations

import os
import signal
import time

import pytest

from harness import WorldFailed, run_world
from reference import global_batches, rank_micro_batch, tiny_gpt


def _die_mid_step(rank: int, world: int) -> None:
    import zerokit

    model = tiny_gpt()
    engine, _, _, _ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "comm_timeout_s": 30,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}})
    for step, batch in enumerate(global_batches(4, 2 * world)):
        x, y = rank_micro_batch(batch, rank, world, 0, 1)
        loss = engine(x, y)
        if step == 2 and rank == 1:
            time.sleep(1.5)  # let its heartbeat be seen, then die in the middle of the step
            os.kill(os.getpid(), signal.SIGKILL)
        engine.backward(loss)
        engine.step()


def test_dead_rank_stops_the_others_with_its_name() -> None:
    start = time.monotonic()
    with pytest.raises(WorldFailed) as info:
        run_world(_die_mid_step, 2, timeout=120, comm_timeout=30)
    elapsed = time.monotonic() - start
    text = str(info.value)
    assert "rank 1: exited with code -9" in text, text
    assert "CollectiveError" in text and "rank 0/2" in text, text
    assert "rank(s) [1] stopped responding" in text, text
    assert "unit '" in text, text  # where: the unit whose collective failed
    assert elapsed < 60, f"took {elapsed:.0f}s: the surviving rank waited instead of failing"
