"""Stage 3 beyond the parity grid: tied and reused modules, changing control flow, ranks that
diverge, prefetch, and per-rank weight bytes."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from harness import WorldFailed, run_world
from reference import SEQ, global_batches, rank_micro_batch

STEPS, MICRO, LR = 4, 2, 1e-2
STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 5000,
          "stage3_max_reuse_distance": 0}


class Tricky(nn.Module):
    """Tied embedding/head, a block called twice per forward, and a block skipped on odd steps."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 24)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 24))
                                    for _ in range(3))
        self.head = nn.Linear(24, 256, bias=False)
        self.head.weight = self.emb.weight
        self.skip_middle = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + self.blocks[0](h)
        if not self.skip_middle:
            h = h + self.blocks[1](h)
        h = h + self.blocks[2](h)
        h = h + self.blocks[0](h)  # the first block again
        return nn.functional.cross_entropy(self.head(h).view(-1, 256), y.view(-1))


def _make(seed: int = 0) -> Tricky:
    torch.manual_seed(seed)
    return Tricky()


def _train(rank: int, world: int, diverge: bool = False, stage: int = 3) -> dict:
    import zerokit

    model = _make()
    engine, _, _, _ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MICRO, "comm_timeout_s": 30,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": STAGE3 if stage == 3 else {"stage": stage}})
    losses, weight_bytes, peaks = [], [], []
    for step, batch in enumerate(global_batches(STEPS, MICRO * world)):
        model.skip_middle = step % 2 == 1
        if diverge and step == 2:
            model.skip_middle = rank == 1  # only rank 1 skips: the ranks disagree
        x, y = rank_micro_batch(batch, rank, world, 0, 1)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        t = loss.detach().view(1).clone()
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
        weight_bytes.append(engine.ledger.bytes(kind="weights"))
        peaks.append(engine.ledger.bytes(kind="weights", peak=True))
    stats = dict(engine.scheduler.stats) if engine.scheduler is not None else {}
    full = engine.consolidated_fp32_state_dict()
    engine.destroy()
    return {"losses": losses, "weights": full, "bytes": weight_bytes, "peak": peaks, "stats": stats,
            "numel": sum(p.numel() for p in model.parameters()),
            "largest_unit": max(u.padded_numel for u in engine.units)}


def _reference() -> tuple[list[float], dict]:
    model = _make()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step, (x, y) in enumerate(global_batches(STEPS, MICRO * 2)):
        model.skip_middle = step % 2 == 1
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def test_tied_reused_and_skipped_modules_match_reference_and_prefetch() -> None:
    ref_losses, ref_weights = _reference()
    for r in run_world(_train, 2):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for name, w in ref_weights.items():
            torch.testing.assert_close(r["weights"][name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert r["weights"]["head.weight"] is r["weights"]["emb.weight"] or \
            torch.equal(r["weights"]["head.weight"], r["weights"]["emb.weight"])
        stats = r["stats"]
        # The order changes every step (block 1 skipped on odd steps): each iteration re-records,
        # and prefetch still ran where the recorded order held.
        assert stats["recorded"] >= STEPS - 1, stats
        assert stats["prefetched"] > 0, stats
        # Between steps a rank holds only its shard of the weights: 1/N of the model + padding.
        per_rank = r["numel"] * 4 / 2
        assert all(b <= per_rank + 4 * 32 * 2 * 5 for b in r["bytes"]), (r["bytes"], per_rank)
        # The gathered window is bounded by what the config allows to be live: the unit in use,
        # the one kept for a reuse (block 0 runs twice), and the prefetch budget, on top of the shard.
        window = 4 * (2 * r["largest_unit"] + STAGE3["stage3_prefetch_bucket_size"])
        assert max(r["peak"]) <= per_rank + 4 * 32 * 2 * 5 + window, (r["peak"], per_rank, window)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ranks_taking_different_paths_fail_naming_the_units(stage: int) -> None:
    # Stage 3 notices before the first diverging use; stages 0-2 when the backward's reductions
    # are compared, before the step applies them.
    with pytest.raises(WorldFailed) as info:
        run_world(_train, 2, True, stage, timeout=120, comm_timeout=30)
    text = str(info.value)
    assert "ranks diverged" in text and "unit 'blocks." in text, text
    assert "rank 0:" in text and "rank 1:" in text, text


# ---- the scheduler alone (gather/scheduler.py), one process, units that only count -----------
class CountingUnit:
    """What the scheduler reads of a unit, with gathers and releases recorded, no bytes."""

    def __init__(self, name: str, padded_numel: int, log: list) -> None:
        from zerokit.states import WeightState

        self.name, self.numel, self.padded_numel, self.shard_numel = name, padded_numel, padded_numel, 0
        self.state, self.nvme_shard, self.module = WeightState.SHARDED, None, nn.Identity()
        self.weights_are_shard = False
        self._log = log

    def gather(self) -> None:
        from zerokit.states import WeightState

        if self.state is WeightState.SHARDED:
            self._log.append(("gather", self.name))
        self.state = WeightState.GATHERED

    def release(self) -> None:
        from zerokit.states import WeightState

        self.state = WeightState.SHARDED

    def wait_weights(self) -> None:
        pass


def _scheduler(sizes: list[int], **zero) -> tuple[object, list[CountingUnit], list]:
    from zerokit.config import load_config
    from zerokit.gather.scheduler import Stage3Scheduler

    cfg = load_config({"train_micro_batch_size_per_gpu": 1,
                       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                             "stage3_max_reuse_distance": 0, **zero}})
    log: list = []
    units = [CountingUnit(f"u{i}", n, log) for i, n in enumerate(sizes)]
    return Stage3Scheduler(units, None, cfg.zero_optimization, nn.Identity()), units, log


def _iteration(sched, units, order) -> None:
    sched.start_iteration()
    for i in order:
        sched.use(units[i])
        sched.after_forward(units[i], torch.zeros(1))  # no grad: releases (not the root)
    sched.end_backward()


def test_scheduler_records_then_prefetches_within_the_bucket() -> None:
    sched, units, log = _scheduler([100, 100, 100, 100], stage3_prefetch_bucket_size=250)
    _iteration(sched, units, [0, 1, 2, 3])
    # Step 0 records: each unit gathered at its own use, nothing ahead.
    assert log == [("gather", f"u{i}") for i in range(4)] and sched.stats["prefetched"] == 0
    assert [u.name for u in sched.trace] == ["u0", "u1", "u2", "u3"]
    log.clear()
    sched.start_iteration()
    sched.use(units[0])
    # Step 1 follows the trace: u1 and u2 (200 elements) fit the 250-element bucket, u3 not.
    assert log == [("gather", "u0"), ("gather", "u1"), ("gather", "u2")]
    assert sched.position() == ("stage-3 use 1 of this iteration, last unit 'u0' (the recorded "
                                "order has 4 uses)")


def test_scheduler_stops_predicting_when_the_order_changes_and_records_the_new_one() -> None:
    sched, units, log = _scheduler([100, 100, 100, 100], stage3_prefetch_bucket_size=150)
    _iteration(sched, units, [0, 1, 2, 3])
    log.clear()
    _iteration(sched, units, [0, 2, 1, 3])
    # u0 follows the trace and prefetches u1 (150 elements: one unit ahead); u2 breaks the
    # order, so from there each unit is gathered at its use, none ahead (still predicting, the
    # use of u2 would have prefetched u3).
    assert log == [("gather", "u0"), ("gather", "u1"), ("gather", "u2"), ("gather", "u3")]
    assert sched.stats["prefetched"] == 1
    assert [u.name for u in sched.trace] == ["u0", "u2", "u1", "u3"] and sched.stats["recorded"] == 2


def test_scheduler_never_holds_more_than_max_live_parameters() -> None:
    sched, units, log = _scheduler([100, 100, 100, 100], stage3_prefetch_bucket_size=1000,
                                   stage3_max_live_parameters=250)
    _iteration(sched, units, [0, 1, 2, 3])
    log.clear()
    sched.start_iteration()
    sched.use(units[0])
    # u0 is live (100); u1 brings it to 200; u2 would make 300 > 250.
    assert log == [("gather", "u0"), ("gather", "u1")]


# ---- [Note: gathered weights keep their address] (units/unit.py) ------------------------------
def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s whole pages the kernel holds in RAM now (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    start, end = -(-ptr // page) * page, (ptr + nbytes) // page * page
    vec = (ctypes.c_ubyte * ((end - start) // page))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) == 0
    return sum(v & 1 for v in vec) * page


class Wide(nn.Module):
    """Two 2 MiB blocks (fp32) around a small embedding: units large enough to count pages."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 128)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(128, 2048), nn.GELU(), nn.Linear(2048, 128))
                                    for _ in range(2))
        self.head = nn.Linear(128, 256)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return nn.functional.cross_entropy(self.head(h).view(-1, 256), y.view(-1))


def _address_world(rank: int, world: int) -> dict:
    import zerokit

    torch.manual_seed(0)
    model = Wide()
    engine, _, _, _ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MICRO, "comm_timeout_s": 30,
        "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": STAGE3})
    blocks = [u for u in engine.units if u.module in set(model.blocks)]
    gathered = []  # resident bytes of each block's weights while its forward runs
    for block, unit in zip(model.blocks, blocks):  # inside the block: while it is gathered
        block[0].register_forward_hook(lambda m, i, o, u=unit: gathered.append(
            (_resident_bytes(u.flat), u.flat.numel() * u.flat.element_size())))
    addresses, released = [], []
    for batch in global_batches(3, MICRO * world):
        x, y = rank_micro_batch(batch, rank, world, 0, 1)
        engine.backward(engine(x, y))
        engine.step()
        addresses.append([u.flat.data_ptr() for u in blocks])
        released.append([_resident_bytes(u.flat) for u in blocks])
    engine.destroy()
    return {"addresses": addresses, "released": released, "gathered": gathered,
            "states": [u.keeps_address and not u.persistent for u in blocks]}


def test_gathered_weights_keep_their_address_and_hand_back_their_pages() -> None:
    """Stage 3 on a CPU device: a block's weights are gathered into the same memory every time
    and its pages go back to the kernel at each release (not to malloc's heap, whose memory the
    process's RSS keeps)."""
    for r in run_world(_address_world, 2, timeout=120):
        assert r["states"] == [True, True]
        assert all(a == r["addresses"][0] for a in r["addresses"]), r["addresses"]
        for nbytes, size in r["gathered"]:
            assert nbytes >= size - 4096, (nbytes, size)  # gathered: every page resident
        for after_step in r["released"]:
            assert after_step == [0, 0], r["released"]  # released: none
