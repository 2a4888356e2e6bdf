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
