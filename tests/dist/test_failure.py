"""A rank that dies mid-step makes the others stop with a message naming it, instead of hanging."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch
import torch.nn as nn

from harness import WorldFailed, run_world
from reference import global_batches, rank_micro_batch, tiny_gpt
from fast_tier import slow_except


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


# ---- ranks that take different paths (see [Note: rank agreement] in comm/agreement.py) ---------
class Branchy(nn.Module):
    """Blocks run in `order` (set per rank per step): equal widths make equal-sized units, which
    would pair silently wrong; different widths make unequal ones, which would abort gloo."""

    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, w), nn.GELU(), nn.Linear(w, 16))
                                    for w in widths)
        self.head = nn.Linear(16, 256, bias=False)
        self.order = list(range(len(widths)))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for i in self.order:
            h = h + self.blocks[i](h)
        return nn.functional.cross_entropy(self.head(h).view(-1, 256), y.view(-1))


EQUAL, UNEQUAL = (32, 32, 32), (24, 40, 56)
STAGE3_PREFETCH = {"stage": 3, "stage3_param_persistence_threshold": 0,
                   "stage3_prefetch_bucket_size": 4000, "stage3_max_reuse_distance": 0}


def _diverge(rank: int, world: int, widths: tuple[int, ...], stage: int, agreement: str) -> None:
    import zerokit

    torch.manual_seed(0)
    model = Branchy(widths)
    engine, _, _, _ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "comm_timeout_s": 30,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": STAGE3_PREFETCH if stage == 3 else {"stage": stage}})
    if agreement != "default":
        engine.comm._start_agreement(agreement)  # the NCCL logic, on gloo
    for step, batch in enumerate(global_batches(3, 2 * world)):
        # Step 0 agrees (stage 3 records its order and prefetches from step 1 on); at step 1 every
        # rank but 0 runs the last two blocks swapped.
        model.order = [0, 2, 1] if step == 1 and rank > 0 else [0, 1, 2]
        x, y = rank_micro_batch(batch, rank, world, 0, 1)
        engine.backward(engine(x, y))
        engine.step()


def _expect_divergence(world: int, widths: tuple[int, ...], stage: int,
                       agreement: str = "default") -> None:
    start = time.monotonic()
    with pytest.raises(WorldFailed) as info:
        run_world(_diverge, world, widths, stage, agreement, timeout=120, comm_timeout=30)
    elapsed = time.monotonic() - start
    text = str(info.value)
    reports = [part for part in text.split("\n") if part.startswith("rank ") and ": " in part[:9]]
    assert {int(p.split(":")[0][5:]) for p in reports} == set(range(world)), text  # every rank fails
    # Each rank names its own unit and another rank's, and they differ.
    named = re.findall(r"rank (\d)/\d+: ranks diverged: this rank's \w+ for unit '([\w.]+)'"
                       r"(?: bucket \d+)? \(\d+ bytes\) met (?:rank \d|another rank)'s \w+ for "
                       r"unit '([\w.]+)'", text)
    assert {int(r) for r, _, _ in named} == set(range(world)), text
    assert all(mine != theirs for _, mine, theirs in named), named
    # Each rank says where it was (engine/health.py::describe_position), at every stage: step 1
    # is where the ranks diverge; stage 3 adds the position in its order of uses.
    at = [re.search(r"this rank was at global step (\d+), (\w+)([^.]*)", p) for p in reports]
    assert all(at) and all(m.group(1) == "1" for m in at), reports
    assert all(("stage-3 use" in m.group(3)) == (stage == 3) for m in at), reports
    assert "exited with code" not in text, text  # no gloo abort
    assert elapsed < 60, f"took {elapsed:.0f}s: a rank waited for the timeout instead of failing"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_equal_sized_units_on_different_paths_fail_naming_both(stage: int) -> None:
    _expect_divergence(2, EQUAL, stage)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_unequal_sized_units_on_different_paths_fail_naming_both(stage: int) -> None:
    _expect_divergence(2, UNEQUAL, stage)


@pytest.mark.slow
@pytest.mark.parametrize("widths,stage", [(EQUAL, 3), (UNEQUAL, 2)])
def test_divergence_in_a_world_of_4_fails_on_every_rank(widths: tuple[int, ...], stage: int) -> None:
    _expect_divergence(4, widths, stage)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_lagged_checks_of_nccl_name_the_units_too(stage: int) -> None:
    # Equal sizes only: the lagged checks let data move before the check, which gloo cannot
    # survive for unequal sizes (NCCL would compute garbage, never used: the step settles first).
    _expect_divergence(2, EQUAL, stage, agreement="lagged")


def _all_reduces_per_step(rank: int, world: int, stage: int) -> list[int]:
    import torch.distributed as dist

    import zerokit

    torch.manual_seed(0)
    model = Branchy((32, 32, 32, 32))  # 5 units: a check per unit would be >= 5 per step
    engine, _, _, _ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "comm_timeout_s": 30,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": STAGE3_PREFETCH if stage == 3 else {"stage": stage}})
    model.order = [0, 1, 2, 3]
    calls = [0]
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)
    counts = []
    for batch in global_batches(3, 2 * world):
        x, y = rank_micro_batch(batch, rank, world, 0, 1)
        calls[0] = 0
        dist.all_reduce = counting
        try:
            engine.backward(engine(x, y))
            engine.step()
        finally:
            dist.all_reduce = real
        counts.append(calls[0])
    return counts


@pytest.mark.parametrize("stage", slow_except([2, 3], fast=[2]))
def test_rank_agreement_adds_no_round_trip_per_unit(stage: int) -> None:
    # Stage 2 and 3 move gradients and weights point-to-point on gloo: the only all-reduce left in
    # a step is the used-units flags. The agreement travels inside the exchanges.
    for counts in run_world(_all_reduces_per_step, 2, stage):
        assert all(c <= 1 for c in counts), counts
