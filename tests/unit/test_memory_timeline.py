"""The memory timeline (engine.memory_timeline(), `zerokit plot`): each change of the ledger's
counts through a step, with its phase. Checked against byte counts computed here from the
model's parameters (plain torch numel), not against the ledger."""
from __future__ import annotations

import sys

import pytest
import torch

import zerokit
from harness import run_world
from reference import tiny_gpt

ALIGN = 32  # elements per shard boundary (policy/layout.py ALIGN): a unit pads to world * ALIGN
WORLD = 2  # one rank gathers nothing: its shard is its weights ([Note: one rank's shard is its
# weights] in policy/layout.py)


def _padded(module: torch.nn.Module, exclude=()) -> int:
    n = sum(p.numel() for p in module.parameters() if all(p is not q for q in exclude))
    return -(-n // (WORLD * ALIGN)) * (WORLD * ALIGN)


def _stage3_run(rank: int, world: int):
    torch.set_num_threads(1)
    model = tiny_gpt()
    blocks = list(model.transformer.h)
    engine, *_ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}})
    x = torch.randint(0, 50, (2, 16))
    for _ in range(2):
        engine.backward(engine(x, x))
        engine.step()
    block_params = [p for b in blocks for p in b.parameters()]
    root = _padded(model, exclude=block_params)
    sizes = [_padded(b) for b in blocks]
    timeline = engine.memory_timeline()
    engine.destroy()
    return timeline, root, sizes


@pytest.fixture(scope="module")
def stage3_timeline():
    """Stage 3, fp32, two ranks, nothing kept gathered or prefetched: while a block runs
    forward, rank 0's device holds its shard of every unit, the root unit (gathered for the whole
    step) and that block."""
    return run_world(_stage3_run, WORLD)[0]


def test_phases_name_each_units_forward_then_backward_and_step(stage3_timeline) -> None:
    timeline, _, sizes = stage3_timeline
    phases = []
    for _, phase, *_ in timeline.events:
        if not phases or phases[-1] != phase:
            phases.append(phase)
    forward = [p for p in phases if p.startswith("forward ")]
    assert forward[:len(sizes) + 1] == ["forward <root>"] + [f"forward transformer.h.{i}" for i in range(len(sizes))]
    assert "backward" in phases and phases.index("backward") > phases.index(forward[-1])
    assert phases[-1] == "step" or "step" in phases


def test_weights_while_a_block_runs_are_shards_root_and_that_block(stage3_timeline) -> None:
    timeline, root, sizes = stage3_timeline
    shards = 4 * (root + sum(sizes)) // WORLD  # fp32: a shard is its rank's part of the padded unit
    for i, size in enumerate(sizes):
        during = [table["device"]["weights"] for _, phase, table in timeline.totals()
                  if phase == f"forward transformer.h.{i}"]
        assert max(during) == shards + 4 * (root + size), (i, during)


def test_timeline_saves_and_loads(stage3_timeline, tmp_path) -> None:
    from zerokit.tiers.timeline import MemoryTimeline

    timeline, *_ = stage3_timeline
    timeline.save(str(tmp_path / "t.json"))
    again = MemoryTimeline.load(str(tmp_path / "t.json"))
    assert again.events == timeline.events and again.peak("device") == timeline.peak("device")


def test_plot_without_matplotlib_says_which_extra(stage3_timeline, tmp_path, monkeypatch) -> None:
    from zerokit.memory.plot import plot_timeline

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"zerokit\[plot\]"):
        plot_timeline(stage3_timeline[0], str(tmp_path / "t.png"))


def test_plot_writes_a_png(stage3_timeline, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from zerokit.cli import main

    stage3_timeline[0].save(str(tmp_path / "t.json"))
    assert main(["plot", str(tmp_path / "t.json")]) == 0
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
