"""The ledger's per-rank bytes follow the ZeRO memory model: 1/N where the stage partitions."""
from __future__ import annotations

import torch

from harness import run_world
from reference import global_batches, rank_micro_batch, tiny_gpt


def _bytes_after_one_step(rank: int, world: int) -> dict:
    import zerokit

    out = {}
    for dtype in ("fp32", "bf16"):
        for stage in (0, 1, 2):
            model = tiny_gpt()
            engine, _, _, _ = zerokit.initialize(model=model, config={
                "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": dtype == "bf16"},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": stage}})
            x, y = rank_micro_batch(global_batches(1, 2 * world)[0], rank, world, 0, 1)
            engine.backward(engine(x, y))
            engine.step()
            led = engine.ledger
            out[(dtype, stage)] = {kind: led.bytes(kind=kind) for kind in
                                   ("weights", "grads", "master", "optimizer_state")}
            out[(dtype, stage)]["elements"] = sum(u.numel for u in engine.units)
            out[(dtype, stage)]["padded"] = sum(u.padded_numel for u in engine.units)
            engine.destroy()
    return out


def test_partitioned_bytes_are_one_nth() -> None:
    world = 4
    for rank, b in enumerate(run_world(_bytes_after_one_step, world)):
        n, padded = b[("fp32", 0)]["elements"], b[("fp32", 0)]["padded"]
        pad = (padded - n) * 12  # padding elements carry state too: allow them
        for dtype in ("fp32", "bf16"):
            s0, s1, s2 = (b[(dtype, s)] for s in (0, 1, 2))
            state0 = s0["optimizer_state"] + s0["master"]
            for s in (s1, s2):  # optimizer state + master: 1/N at stage >= 1
                assert abs((s["optimizer_state"] + s["master"]) - state0 / world) <= pad, (dtype, rank, b)
            # Every stage keeps full compute weights (stage 3 is what shards them).
            assert s0["weights"] == s1["weights"] == s2["weights"]
        # fp32, stage 0: gradients are DDP's one full fp32 buffer; stage 2 keeps only a 1/N shard.
        f0, f2 = b[("fp32", 0)], b[("fp32", 2)]
        assert f0["grads"] == padded * 4
        assert f2["grads"] == padded * 4 // world
        # Adam keeps two fp32 moments per element (plus a step counter per unit).
        assert abs(f0["optimizer_state"] - 8 * padded) < 1024
        # bf16 stage 0: 2-byte gradients + fp32 master gradient; master weights 4 B per element.
        h0, h2 = b[("bf16", 0)], b[("bf16", 2)]
        assert h0["grads"] == padded * (2 + 4) and h0["master"] == padded * 4
        assert h2["grads"] == padded * 4 // world and h2["master"] == padded * 4 // world


def _ledger_and_rss_growth(rank: int, world: int) -> dict:
    """Build one unit whose layout offloads its optimizer range (Twin-Flow 3/4, delayed update:
    host master, two host gradients, 16-bit output; then the host optimizer state) and measure
    this process's RSS growth around it: on a CPU machine the device tier is host memory too."""
    import psutil

    from zerokit.comm.collectives import Comm
    from zerokit.units.unit import Unit
    from zerokit.policy import PartitionPolicy, PlacementPolicy
    from zerokit.tiers import Ledger

    comm = Comm.from_environment(60.0)
    weights = [torch.randn(1024, 1024) for _ in range(6)]  # kept: nothing the unit copies is freed
    params = [(f"w{i}", torch.nn.Parameter(w)) for i, w in enumerate(weights)]
    ledger = Ledger()
    proc = psutil.Process()
    before = proc.memory_info().rss
    unit = Unit("u", params, module=None, trainable=True, group_index=0, comm=comm,
                policy=PartitionPolicy.for_stage(1), compute_dtype=torch.bfloat16,
                reduce_dtype=torch.bfloat16, bucket_numel=1 << 20, ledger=ledger,
                placement=PlacementPolicy(ratio=0.75, delayed=True))
    (host,) = [p for p in unit.parts if p.tier == "host"]
    host.init_state("adam")
    grown = proc.memory_info().rss - before
    return {"grown": grown, "host": ledger.bytes(tier="host"), "device": ledger.bytes(tier="device"),
            "host_records": sum(unit.layout.bytes("host").values()), "host_numel": host.numel}


def test_ledger_bytes_are_the_allocated_bytes(monkeypatch) -> None:
    # A fixed mmap threshold returns every large block to the OS on free and maps each large
    # allocation afresh, so RSS follows live bytes (see test_zero_init).
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    (r,) = run_world(_ledger_and_rss_growth, 1)
    k = r["host_numel"]
    # master 4 + two gradients 8 + bf16 output 2 + Adam's two moments 8 bytes per host element.
    assert r["host"] == k * (4 + 8 + 2 + 8) == r["host_records"] + 8 * k, r
    measured = r["grown"]
    counted = r["host"] + r["device"]  # what the tiers allocated, by the ledger
    assert abs(measured - counted) < 0.03 * counted + (4 << 20), (measured, counted, r)
