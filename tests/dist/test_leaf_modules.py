"""Leaf modules (see [Note: leaf modules] in units/leaf.py): an MoE block whose ranks run different
experts trains at stage 3 and equals the one-process reference; unmarked, it fails by the rule."""
from __future__ import annotations

import re
import time

import pytest
import torch
import torch.nn as nn

from harness import WorldFailed, run_world
from reference import SEQ, reference_train
from fast_tier import slow_except

pytestmark = pytest.mark.robustness

E, D, MICRO, STEPS, LR = 3, 16, 3, 3, 0.1


class Expert(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(D, 24), nn.GELU(), nn.Linear(24, D))


class MoE(nn.Module):
    """Each sample goes to the expert its first token names (so ranks run different experts),
    weighted by the router's probability for it (so the router learns too)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))

    def forward(self, h: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(self.router(h.mean(1)), -1).gather(1, choice[:, None])[:, :, None]
        out = h
        for e in sorted(set(choice.tolist())):
            rows = choice == e
            out = out.index_add(0, rows.nonzero()[:, 0], gate[rows] * self.experts[e](h[rows]))
        return out


class MoEModel(nn.Module):
    """A top-level MoE (its experts would be units of their own: the outermost ModuleList) and an
    MoE inside the blocks list (a unit whose gradients arrive per rank differently)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, D)
        self.moe = MoE()
        self.blocks = nn.ModuleList([MoE()])
        self.head = nn.Linear(D, 256, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        choice = x[:, 0] % E
        h = self.blocks[0](self.moe(self.emb(x), choice), (choice + 1) % E)
        return nn.functional.cross_entropy(self.head(h).view(-1, 256), y.reshape(-1))


def _make() -> MoEModel:
    torch.manual_seed(0)
    return MoEModel()


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank 0's samples pick every expert, rank r > 0's only expert r % E: rank 0's MoE units get
    all their gradients during backward, the others' never (some experts ran on no row)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 256, (MICRO * world, SEQ + 1), generator=g)
        j = torch.arange(MICRO * world)
        expert = torch.where(j < MICRO, j % E, (j // MICRO) % E)
        tokens[:, 0] = expert + E * torch.randint(0, 256 // E, (MICRO * world,), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _train(rank: int, world: int, stage: int, mark: bool) -> dict[str, torch.Tensor]:
    import zerokit

    model = _make()
    if mark:
        zerokit.zero.set_leaf_modules(model, [MoE])
    engine, _, _, _ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MICRO, "comm_timeout_s": 20,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "stage3_prefetch_bucket_size": 2000, "stage3_max_reuse_distance": 0}})
    if mark:
        assert [u.name for u in engine.units] == ["moe", "blocks.0", "<root>"], engine.units
    for x, y in _batches(world):
        lo = rank * MICRO
        engine.backward(engine(x[lo:lo + MICRO], y[lo:lo + MICRO]))
        engine.step()
    return engine.consolidated_fp32_state_dict()


@pytest.mark.parametrize("world", slow_except([2, 4], fast=[2]))
def test_moe_leaf_with_per_rank_experts_equals_reference(world: int) -> None:
    _, expected = reference_train(_make, lambda p: torch.optim.SGD(p, lr=LR), _batches(world))
    for stage in (3, 2):
        got = run_world(_train, world, stage, True, timeout=180)
        for state in got:
            for name, ref in expected.items():
                torch.testing.assert_close(state[name], ref, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"stage {stage} {name}: {m}")
        # Experts that ran on some rank moved; all ranks hold the same weights.
        assert not torch.equal(got[0]["moe.experts.1.0.weight"], _make().moe.experts[1][0].weight)


def test_unmarked_moe_fails_naming_unit_parameters_and_positions() -> None:
    start = time.monotonic()
    with pytest.raises(WorldFailed) as info:
        run_world(_train, 2, 3, False, timeout=120, comm_timeout=20)
    elapsed = time.monotonic() - start
    text = str(info.value)
    assert "exited with code" not in text, text
    for rank in (0, 1):
        report = next(p for p in text.split("\nrank ") if p.lstrip("rank ").startswith(f"{rank}:"))
        assert re.search(rf"rank {rank}/2: ranks diverged: .* unit 'moe\.experts\.\d'", report), report
        assert re.search(r"unit 'moe\.experts\.\d' holds moe\.experts\.\d\.0\.weight", report), report
        assert re.search(r"this rank was at global step \d+, (forward|backward)", report), report
    assert elapsed < 60, f"took {elapsed:.0f}s"
