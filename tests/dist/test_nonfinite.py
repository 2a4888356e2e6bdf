"""Non-finite steps in bf16 and fp32 (see [Note: non-finite steps] in engine/health.py): a NaN
gradient injected on one rank is reported with the step and the first unit holding it, and the
step is skipped (counted) or stops every rank, by the `nonfinite` key; never written."""
from __future__ import annotations

import logging

import pytest
import torch

from harness import run_world
from reference import global_batches, rank_micro_batch, reference_train, tiny_gpt
from fast_tier import slow_except

pytestmark = pytest.mark.robustness

STEPS, MICRO, LR, BAD_STEP = 4, 2, 0.05, 1


def _train(rank: int, world: int, stage: int, dtype: str, mode: str, what: str) -> dict:
    import zerokit

    model = tiny_gpt()
    engine, _, _, _ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MICRO, "comm_timeout_s": 30, "nonfinite": mode,
        "bf16": {"enabled": dtype == "bf16"}, "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    inject = [False]
    weight = model.transformer.h[1].mlp.c_fc.weight
    weight.register_hook(lambda g: g * float("nan") if inject[0] else g)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("zerokit").addHandler(handler)
    errors = []
    for step, batch in enumerate(global_batches(STEPS, MICRO * world)):
        inject[0] = step == BAD_STEP and rank == 1 and what == "grad"
        x, y = rank_micro_batch(batch, rank, world, 0, 1)
        loss = engine(x, y)
        if step == BAD_STEP and rank == 0 and what == "loss":
            loss = loss * float("inf")
        engine.backward(loss)
        try:
            engine.step()
        except zerokit.NonFiniteError as e:
            errors.append(str(e))
    return {"state": engine.consolidated_fp32_state_dict(), "skipped": engine.skipped_steps,
            "steps": engine.global_steps, "log": seen, "errors": errors}


def _reference(world: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    batches = [b for i, b in enumerate(global_batches(STEPS, MICRO * world)) if i != BAD_STEP]
    return reference_train(tiny_gpt, lambda p: torch.optim.SGD(p, lr=LR), batches, dtype=dtype,
                           chunks=world if dtype != torch.float32 else 1)[1]


@pytest.mark.parametrize("mode", slow_except(["skip", "stop"], fast=["skip"]))
def test_nan_gradient_in_bf16_and_fp32_is_reported_and_never_applied(mode: str) -> None:
    world = 2
    for dtype, stage in (("bf16", 2), ("fp32", 0), ("bf16", 3)):
        ref = _reference(world, torch.bfloat16 if dtype == "bf16" else torch.float32)
        tol = dict(rtol=2e-2, atol=2e-3) if dtype == "bf16" else dict(rtol=1e-5, atol=1e-6)
        for rank, out in enumerate(run_world(_train, world, stage, dtype, mode, "grad")):
            for name, expected in ref.items():
                torch.testing.assert_close(out["state"][name], expected, **tol,
                                           msg=lambda m: f"{dtype} stage {stage} {name}: {m}")
            assert out["steps"] == (STEPS if mode == "skip" else STEPS - 1), out["steps"]
            if mode == "skip":
                assert out["skipped"] == 1 and not out["errors"], out
                if rank == 0:
                    report = [m for m in out["log"] if "non-finite" in m]
                    assert len(report) == 1, out["log"]
                    text = report[0]
            else:
                assert out["skipped"] == 0 and len(out["errors"]) == 1, out
                text = out["errors"][0]
            if mode == "stop" or rank == 0:
                assert f"step {BAD_STEP}:" in text and "unit 'transformer.h.1'" in text, text
                assert "transformer.h.1.mlp.c_fc.weight" in text or "..." in text, text


def test_non_finite_loss_is_named_and_skipped() -> None:
    out = run_world(_train, 2, 1, "bf16", "skip", "loss")
    assert [o["skipped"] for o in out] == [1, 1]
    report = [m for m in out[0]["log"] if "non-finite" in m]
    assert report and f"step {BAD_STEP}: 1 non-finite loss(es)" in report[0], out[0]["log"]
