"""Stage 1 without accumulation reduces as stage 2 does (policy/partition.py `for_accumulation`).

With one micro-step per step every backward is a boundary, so the full-size gradient buffer that
stage 1 keeps for accumulating is pure cost (issue #29). These tests pin down what must not
change with it: the update equals the torch reference (SGD, scale-sensitive), also when a caller
drives the boundary itself (Accelerate's `set_gradient_accumulation_boundary`) with
gradient_accumulation_steps 1; and what changes: the full-size gradient is gone at
accumulation 1 and kept at accumulation 2 (bytes in the ledger).
"""
from __future__ import annotations

import torch

from harness import run_world
from reference import global_batches, rank_micro_batch, reference_train, tiny_gpt

LR, MICRO, STEPS = 0.5, 2, 3


def _config(gas: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "zero_optimization": {"stage": 1, "reduce_bucket_size": 2000}}


def _train(rank: int, world: int, gas: int, manual: int) -> dict:
    """gas: the config's accumulation; manual > 0: the config says 1 and the caller marks every
    `manual`-th micro-step as the boundary, as Accelerate does."""
    import zerokit

    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config=_config(gas))
    per_step = manual or gas
    grads = engine.ledger.bytes(tier="device", kind="grads")
    for batch in global_batches(STEPS, MICRO * world * per_step):
        for micro in range(per_step):
            if manual:
                engine.set_gradient_accumulation_boundary(micro == per_step - 1)
            x, y = rank_micro_batch(batch, rank, world, micro, per_step)
            engine.backward(engine(x, y))
            engine.step()
    out = {"weights": engine.consolidated_fp32_state_dict(), "grads_bytes": grads,
           "param_bytes": sum(p.numel() * 4 for p in engine.module.parameters()),
           "global_steps": engine.global_steps}
    engine.destroy()
    return out


def _reference(lr: float, per_step: int, world: int) -> dict:
    _, weights = reference_train(tiny_gpt, lambda ps: torch.optim.SGD(ps, lr=lr),
                                 global_batches(STEPS, MICRO * world * per_step))
    return weights


def _assert_close(got: dict, ref: dict) -> None:
    for name, w in ref.items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_stage1_accumulation_1_and_2_equal_torch_and_keep_full_gradients_only_to_accumulate():
    one = run_world(_train, 2, 1, 0)
    two = run_world(_train, 2, 2, 0)
    _assert_close(one[0]["weights"], _reference(LR, 1, 2))
    _assert_close(two[0]["weights"], _reference(LR, 2, 2))
    for r in one:  # the master gradient of this rank's shard only: about half the model
        assert r["grads_bytes"] < 0.6 * r["param_bytes"], r["grads_bytes"]
    for r in two:  # the full-size gradient that micro-steps accumulate in, plus the shard's
        assert r["grads_bytes"] >= r["param_bytes"], r["grads_bytes"]


def test_stage1_caller_driven_boundaries_sum_the_micro_steps():
    # gradient_accumulation_steps 1 in the config, two micro-steps per boundary: each backward's
    # loss is not divided, so the step's gradient is the sum of the two micro-batches' means,
    # which is twice the global batch's mean: SGD at 2 x lr on the global batch.
    got = run_world(_train, 2, 1, 2)
    assert got[0]["global_steps"] == STEPS
    _assert_close(got[0]["weights"], _reference(2 * LR, 2, 2))
