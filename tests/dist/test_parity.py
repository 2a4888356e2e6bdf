"""Stages 0, 1, 2, 3 x fp32 / bf16 x world size 1, 2, 4 against the one-process torch reference.

Tolerances: fp32 rtol 1e-5, atol 1e-6 (the issue's).

bf16: the reference runs the global batch through one bf16 forward/backward while each rank runs
its own micro-batches, so gradients differ by bf16 rounding (relative 2^-8 = 0.4% per rounding).
Adam divides each gradient by its running RMS, so where a gradient element is near zero that
rounding noise is amplified up to a full update of ~lr per step, in either direction: the
worst case for one element after S steps is 2 x lr x S. The check is therefore two-part:
  - every element within that worst case (2 x lr x S), and the losses within rtol 1e-2;
  - all but 0.1% of the elements within lr / 10 + rtol 2^-8: a real defect (a missing or double
    averaging, a wrong shard, a stale weight) moves most elements by ~lr per step and fails this.
Adam is nearly invariant to a gradient's scale, so SGD cases (which are not) guard the averaging.
"""
from __future__ import annotations

import pytest
import torch

from harness import run_world
from reference import engine_train, global_batches, reference_train, tiny_gpt
from fast_tier import slow_except

STEPS, MICRO, LR = 5, 2, 1e-3
CASES = [(stage, dtype, gas, "AdamW") for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16")
         for gas in (1, 2)] + [(stage, "fp32", 2, "SGD") for stage in (0, 1, 2, 3)]
OPTIMIZERS = {"AdamW": (torch.optim.AdamW, {"lr": LR, "weight_decay": 0.1}),
              "SGD": (torch.optim.SGD, {"lr": 0.5, "momentum": 0.9})}


def _config(stage: int, dtype: str, gas: int, opt: str) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "optimizer": {"type": opt, "params": OPTIMIZERS[opt][1]},
            "gradient_clipping": 1.0,
            "bf16": {"enabled": dtype == "bf16"},
            # Small buckets so that units are reduced in several collectives; at stage 3 every unit
            # is sharded (no persistence), prefetch one unit ahead, release right after use.
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000,
                                  **({"stage3_param_persistence_threshold": 0,
                                      "stage3_prefetch_bucket_size": 8000,
                                      "stage3_max_reuse_distance": 0} if stage == 3 else {})}}


def _train_zerokit(rank: int, world: int, cases) -> dict:
    import zerokit

    out = {}
    for case in cases:
        stage, dtype, gas, opt = case
        model = tiny_gpt()
        engine, _, _, _ = zerokit.initialize(model=model, config=_config(*case))
        losses = engine_train(engine, global_batches(STEPS, MICRO * world * gas), rank, world, gas)
        # Read right after a step, while weights may be in flight: state_dict must wait.
        compute = {k: v.clone() for k, v in model.state_dict().items()} if stage < 3 else {}
        fp32 = engine.consolidated_fp32_state_dict()
        for name, w in compute.items():
            assert torch.equal(w, fp32[name].to(w.dtype)), f"{case}: state_dict {name} is stale"
        out[case] = (losses, fp32)
        engine.destroy()
    return out


def _reference(dtype: str, world: int, gas: int, opt: str):
    cls, kwargs = OPTIMIZERS[opt]
    return reference_train(
        tiny_gpt, lambda ps: cls(ps, **kwargs),
        global_batches(STEPS, MICRO * world * gas),
        dtype=torch.bfloat16 if dtype == "bf16" else torch.float32, clip=1.0, chunks=world * gas)


def _check(case, got, ref) -> None:
    (losses, weights), (ref_losses, ref_weights) = got, ref
    if case[1] == "fp32":
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for name, w in ref_weights.items():
            torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} {name}: {m}")
    else:
        worst = 2 * LR * STEPS
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-2, atol=0)
        outside, total = 0, 0
        for name, w in ref_weights.items():
            torch.testing.assert_close(weights[name], w, rtol=0, atol=worst,
                                       msg=lambda m: f"{case} {name}: {m}")
            close = (weights[name] - w).abs() <= LR / 10 + 2 ** -8 * w.abs()
            outside += int((~close).sum())
            total += w.numel()
        assert outside <= total * 1e-3, f"{case}: {outside} of {total} elements beyond lr/10"
    assert set(ref_weights) <= set(weights)  # weights also names tied aliases (lm_head.weight)


@pytest.mark.parametrize("world", slow_except([1, 2, 4], fast=[1, 2]))
def test_stages_match_reference(world: int) -> None:
    if world == 1:  # no launcher, no process group: what a notebook user does
        results = [_train_zerokit(0, 1, CASES)]
    else:
        results = run_world(_train_zerokit, world, CASES, timeout=600)
    for case in CASES:
        ref = _reference(case[1], world, case[2], case[3])
        for rank_result in results:
            _check(case, rank_result[case], ref)
