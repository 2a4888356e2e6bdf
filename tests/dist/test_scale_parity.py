"""Scale-sensitive parity: plain SGD, so a gradient off by any factor changes the update.

Every 16-bit parity case in test_parity.py trains with AdamW and clipping to 1.0, and both are
invariant to a common scale of the gradients: a gradient counted twice (stage 0, 16-bit reduce,
accumulation > 1: issue #14) passes them. Here SGD without momentum, clipping or weight decay makes
the update lr x the averaged gradient, so its norm carries the scale.

Grid, in one run_world per world size (1, 2, 4): stage 0-3 x compute fp32 / bf16 / fp16 with a
static loss scale / fp16 with a dynamic one x communication_data_type fp32 / bf16 / fp16 x
gradient accumulation 1 and 2. The reference is tests/reference.py's one-process fp32 torch loop
over the global batch (never zerokit): plain torch, fp32.

What is compared: the whole update d = w_after - w0 (every parameter, flattened) of zerokit's fp32
master against the reference's, by relative norm error | |d| - |d_ref| | / |d_ref| and by cosine.
Bounds, and why:
  - fp32 compute and fp32 reduce: the same arithmetic up to summation order (micro-batches, ranks):
    relative norm error 1e-5, cosine > 1 - 1e-9 (measured: 1e-8 and 1 - 3e-13).
  - anything 16-bit: bf16 keeps 8 significant bits (relative rounding 2^-9; fp16 2^-12). Weights,
    activations and gradients are rounded many times, but the errors are independent and mostly
    cancel in a norm over ~20k elements; measured on this grid (worlds 1, 2, 4): norm error at most
    3.6e-4 and cosine at least 1 - 2e-5. Bounds: 5e-3 and 0.999, ten and fifty times that. A
    gradient counted twice is a 100% norm error, a missing average over N ranks (N - 1) x 100%,
    a lost micro-step 50%, a loss scale not divided out a factor of 256 or more: all far outside.
Each rank's master is checked (stage 0 replicas that drift apart fail on some rank), and no step
may be skipped (an fp16 overflow would make the comparison meaningless).
"""
from __future__ import annotations

import pytest
import torch

from harness import run_world
from reference import engine_train, global_batches, reference_train, tiny_gpt
from fast_tier import slow_except

STEPS, MICRO, LR = 2, 2, 0.05
COMPUTE = ("fp32", "bf16", "fp16-static", "fp16-dynamic")
CASES = [(stage, compute, comm, gas) for stage in (0, 1, 2, 3) for compute in COMPUTE
         for comm in ("fp32", "bf16", "fp16") for gas in (1, 2)]
BOUNDS = {"exact": (1e-5, 1 - 1e-9), "16-bit": (5e-3, 0.999)}  # (relative norm error, min cosine)


def _config(stage: int, compute: str, comm: str, gas: int) -> dict:
    precision = {"bf16": {"enabled": compute == "bf16"}}
    if compute.startswith("fp16"):
        # Static: a fixed scale of 256; dynamic: starts at 2^10 (no overflow on this model).
        precision["fp16"] = ({"enabled": True, "loss_scale": 256} if compute == "fp16-static" else
                             {"enabled": True, "initial_scale_power": 10})
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "communication_data_type": comm, **precision,
            # Small buckets: units are reduced in several collectives; at stage 3 every unit is
            # sharded and released after use.
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000,
                                  **({"stage3_param_persistence_threshold": 0,
                                      "stage3_max_reuse_distance": 0} if stage == 3 else {})}}


def _train_grid(rank: int, world: int, cases) -> dict:
    import zerokit

    out = {}
    for case in cases:
        gas = case[3]
        model = tiny_gpt()
        engine, _, _, _ = zerokit.initialize(model=model, config=_config(*case))
        engine_train(engine, global_batches(STEPS, MICRO * world * gas), rank, world, gas)
        out[case] = (engine.consolidated_fp32_state_dict(), engine.skipped_steps)
        engine.destroy()
    return out


def _update(weights: dict, start: dict) -> torch.Tensor:
    return torch.cat([(weights[k] - start[k]).reshape(-1) for k in sorted(start)]).double()


def _mismatch(case, rank: int, got: torch.Tensor, ref: torch.Tensor) -> str | None:
    exact = case[1] == "fp32" and case[2] == "fp32"
    max_norm_err, min_cos = BOUNDS["exact" if exact else "16-bit"]
    norm_err = abs(got.norm() - ref.norm()).item() / ref.norm().item()
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=0).item()
    if norm_err <= max_norm_err and cos >= min_cos:
        return None
    return (f"stage {case[0]} compute {case[1]} comm {case[2]} gas {case[3]} rank {rank}: update norm "
        f"{got.norm():.6g} vs reference {ref.norm():.6g} (relative error {norm_err:.3g}, bound "
        f"{max_norm_err}), cosine {cos:.6f} (bound {min_cos})")


def _run(world: int) -> None:
    results = [_train_grid(0, 1, CASES)] if world == 1 else \
        run_world(_train_grid, world, CASES, timeout=600)
    start = {k: v.detach().clone() for k, v in tiny_gpt().named_parameters()}
    failures: list[str | None] = []
    for gas in (1, 2):
        _, ref_weights = reference_train(tiny_gpt, lambda ps: torch.optim.SGD(ps, lr=LR),
                                         global_batches(STEPS, MICRO * world * gas))
        ref = _update(ref_weights, start)
        for case in (c for c in CASES if c[3] == gas):
            for rank, result in enumerate(results):
                weights, skipped = result[case]
                assert skipped == 0, f"{case} rank {rank}: {skipped} steps skipped (fp16 overflow)"
                failures.append(_mismatch(case, rank, _update(weights, start), ref))
    failures = [f for f in failures if f is not None]
    assert not failures, f"{len(failures)} of {len(CASES) * world} cases:\n" + "\n".join(failures)


@pytest.mark.parametrize("world", slow_except([1, 2], fast=[1]))
def test_sgd_update_matches_reference(world: int) -> None:
    _run(world)


@pytest.mark.slow
def test_sgd_update_matches_reference_world4() -> None:
    _run(4)
