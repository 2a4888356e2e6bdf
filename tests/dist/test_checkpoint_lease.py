"""The async-save read lease lives on the engine and reaches an edit through GatheredParameters.

An asynchronous save writes the master and weight shards from where they live (no host copy);
an edit through `GatheredParameters(modifier_rank=)` writes the same bytes, so it must wait
until this rank's shard file is written. The writer is slowed so the edit comes while it reads.
"""
from __future__ import annotations

import time

import torch

from harness import run_world
from reference import tiny_gpt

MICRO = 2
CFG = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
       "zero_optimization": {"stage": 3}, "checkpoint": {"async_save": True}}
EDITED = "transformer.h.0.mlp.c_fc.weight"


def _edit_during_save(rank: int, world: int, root: str) -> dict:
    import zerokit
    from zerokit.checkpoint import save as save_module

    write_rank = save_module.write_rank
    save_module.write_rank = lambda *a, **k: (time.sleep(0.5), write_rank(*a, **k))[1]
    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(0), config=CFG)
    shared = all(u.lease is engine.save_lease for u in engine.units)
    x = torch.randint(0, 256, (MICRO, 16), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x, x))
    engine.step()
    before = engine.consolidated_fp32_state_dict()
    engine.save_checkpoint(root)                       # returns while the writer sleeps
    held = engine.save_lease.held
    param = dict(engine.module.named_parameters())[EDITED]
    with zerokit.zero.GatheredParameters([param], modifier_rank=0):
        if rank == 0:
            param.data.fill_(7.0)
    edited = engine.consolidated_fp32_state_dict()[EDITED]
    zerokit.checkpoint.wait_for_checkpoint(engine)
    engine.destroy()
    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(1), config=CFG)
    engine.load_checkpoint(root)
    loaded = engine.consolidated_fp32_state_dict()
    engine.destroy()
    return {"shared": shared, "held": held, "edit_applied": bool((edited == 7.0).all()),
            "mismatched": [k for k in before if not torch.equal(loaded[k], before[k])]}


def test_edit_waits_for_the_async_writer(tmp_path) -> None:
    for result in run_world(_edit_during_save, 2, str(tmp_path)):
        assert result["shared"] and result["held"] and result["edit_applied"]
        assert result["mismatched"] == []  # the checkpoint holds the weights before the edit
