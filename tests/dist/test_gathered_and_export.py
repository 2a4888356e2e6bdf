"""GatheredParameters (read, and edit with modifier_rank) and save_16bit_model at stage 3."""
from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from harness import run_world
from reference import global_batches, rank_micro_batch, tiny_gpt, TINY


def _run(rank: int, world: int, out_dir: str) -> dict:
    import zerokit
    from zerokit.zero import GatheredParameters

    model = tiny_gpt()
    engine, _, _, _ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    for batch in global_batches(2, 2 * world):
        x, y = rank_micro_batch(batch, rank, world, 0, 1)
        engine.backward(engine(x, y))
        engine.step()
    before = engine.consolidated_fp32_state_dict()
    weight = model.transformer.h[1].mlp.c_fc.weight
    assert weight.shape == (4 * TINY.n_embd, TINY.n_embd)  # logical shape while sharded
    with GatheredParameters(weight):
        read = weight.detach().float().clone()
    with GatheredParameters([weight], modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                weight.fill_(0.5)
    after = engine.consolidated_fp32_state_dict()
    files_one = engine.save_16bit_model(os.path.join(out_dir, "one"))
    files_many = zerokit.export.save_16bit_model(engine, os.path.join(out_dir, "many"),
                                                 max_shard_bytes=20_000)
    # Training goes on from the edited weights on every rank.
    x, y = rank_micro_batch(global_batches(1, 2 * world)[0], rank, world, 0, 1)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return {"before": before, "read": read, "after": after, "one": files_one, "many": files_many}


def test_gathered_parameters_and_16bit_export(tmp_path) -> None:
    import zerokit.export  # noqa: F401  (the test's ranks import it through zerokit)

    results = run_world(_run, 2, str(tmp_path))
    name = "transformer.h.1.mlp.c_fc.weight"
    for r in results:
        # Read: the gathered 16-bit weight is the master rounded to bf16.
        torch.testing.assert_close(r["read"], r["before"][name].bfloat16().float(), rtol=0, atol=0)
        # Edit from rank 0 reached every rank's shard and master; nothing else moved.
        assert torch.equal(r["after"][name], torch.full_like(r["after"][name], 0.5))
        for k, v in r["before"].items():
            if k != name:
                assert torch.equal(r["after"][k], v), k
    after = results[0]["after"]
    one = load_file(results[0]["one"][0])
    assert set(one) == {n for n, _ in tiny_gpt().named_parameters()}  # tied head stored once
    for k, v in one.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, after[k].bfloat16()), k
    many = {}
    for f in results[0]["many"]:
        many.update(load_file(f))
    assert len(results[0]["many"]) > 1 and os.path.exists(tmp_path / "many" / "model.safetensors.index.json")
    assert many.keys() == one.keys() and all(torch.equal(many[k], one[k]) for k in one)
    # Loads into a plain module (the tied head follows the embedding).
    plain = tiny_gpt(seed=7).bfloat16()
    missing, unexpected = plain.load_state_dict(one, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected
    assert torch.equal(plain.lm_head.weight, one["transformer.wte.weight"])
    assert not [f for f in os.listdir(tmp_path / "one") if f.endswith(".tmp")]
