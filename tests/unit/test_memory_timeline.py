"""The memory timeline (engine.memory_timeline(), `zerokit plot`): each change of the ledger's
counts through a step, with its phase, and the process's RSS as the RSS watch sampled it.
Checked against byte counts computed here from the model's parameters (plain torch numel) or
allocated here, not against the ledger."""
from __future__ import annotations

import sys
import time

import pytest
import torch

import zerokit
from harness import run_world
from reference import tiny_gpt
from zerokit.engine.host_budget import RssWatch

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


SPIKE = 256 * 2**20


class _HoldsInForward(torch.nn.Module):
    """tiny_gpt whose forward holds `spike` bytes the ledger never hears of (pages touched:
    resident) for a few RSS samples, and frees them before it returns."""

    def __init__(self):
        super().__init__()
        self.gpt, self.spike = tiny_gpt(), 0

    def forward(self, x, y):
        if self.spike:
            held = torch.ones(self.spike // 4)
            time.sleep(6 * RssWatch.INTERVAL_S)
            del held
        return self.gpt(x, y)


@pytest.fixture(scope="module")
def rss_timelines():
    """One rank, stage 0, in this process: (a step as the ones before it, then the same step
    with SPIKE held in forward)."""
    torch.set_num_threads(1)
    model = _HoldsInForward()
    engine, *_ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 0}})
    x = torch.randint(0, 50, (2, 16))
    try:
        out = []
        for spike in (0, 0, 0, SPIKE):
            model.spike = spike
            time.sleep(3 * RssWatch.INTERVAL_S)  # samples before the forward: the step's idle start
            engine.backward(engine(x, x))
            engine.step()
            out.append(engine.memory_timeline())
        return out[-2], out[-1]
    finally:
        engine.destroy()


def test_memory_outside_the_ledger_shows_in_the_rss_series_in_its_phase(rss_timelines) -> None:
    steady, spiked = rss_timelines
    assert spiked.rss and steady.rss and spiked.rss_tiers == ("host", "device")  # CPU-only run
    forward = [n for _, phase, n in spiked.rss if phase == "forward <root>"]  # stage 0: one unit
    elsewhere = [n for _, phase, n in spiked.rss if phase != "forward <root>"]
    assert forward and elsewhere
    assert max(forward) - max(elsewhere) > 0.9 * SPIKE, (max(forward), max(elsewhere))
    assert max(forward) - max(n for *_, n in steady.rss) > 0.9 * SPIKE
    assert spiked.rss_peak() == (max(forward), "forward <root>")
    for tier in ("device", "host", "nvme"):  # the ledger never counted it
        assert spiked.peak(tier) == steady.peak(tier), tier


def test_rss_series_saves_and_loads(rss_timelines, tmp_path) -> None:
    from zerokit.tiers.timeline import MemoryTimeline

    spiked = rss_timelines[1]
    spiked.save(str(tmp_path / "t.json"))
    again = MemoryTimeline.load(str(tmp_path / "t.json"))
    assert again.rss == spiked.rss and again.rss_tiers == spiked.rss_tiers
    assert again.rss_peak() == spiked.rss_peak()


def test_a_timeline_saved_before_the_rss_series_loads() -> None:
    from zerokit.tiers.timeline import MemoryTimeline

    old = {"start": [["device", "weights", 1024]], "truncated": False,  # as written before RSS
           "events": [[0.0, "forward", None, None, None], [0.5, "forward", "device", "weights", 3072]]}
    timeline = MemoryTimeline.from_dict(old)
    assert timeline.rss == [] and timeline.rss_peak() is None and timeline.rss_tiers == ("host",)
    assert timeline.peak("device") == 3072


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


def test_plot_draws_the_rss_over_the_ledger(rss_timelines, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from zerokit.memory.plot import plot_timeline

    drawn = []
    real_close = plt.close
    plt.close = lambda fig: drawn.append(fig)  # keep the figure to read its panels
    try:
        plot_timeline(rss_timelines[1], str(tmp_path / "t.png"))
    finally:
        plt.close = real_close
    ax = drawn[0].axes[-1]
    labels = ax.get_legend_handles_labels()[1]
    assert "process RSS (sampled)" in labels and "RSS not counted by the ledger" in labels
    assert "ledger: host" in labels and "ledger: device" in labels
    assert f"({rss_timelines[1].rss_peak()[1]})" in ax.get_title(loc="left")
    real_close(drawn[0])
