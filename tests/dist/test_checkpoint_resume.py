"""Exact resume: save after step k, load into a fresh engine, train on == never stopping, bit for bit.

Stages 0-3 x fp32/bf16 x world size 1 and 2, saved after an even and an odd step; with
offload_optimizer too (stages 1-3: ZeRO-Offload, Twin-Flow ratio 0.4, and the delayed update at
ratio 1 and 0.4, saved once in its warm-up and once with an update pending). The inputs
depend on everything a resume must restore: the engine's own data loader (its epoch and position;
an epoch is 3 batches, so the runs cross epoch boundaries), and per-rank torch / numpy / python
random numbers added to the tokens. An lr warm-up makes the scheduler state matter. The resumed
engine is built from a differently seeded model, so nothing can match by accident.
"""
from __future__ import annotations

import os
import random
import tempfile

import numpy as np
import pytest
import torch

from harness import run_world
from reference import tiny_gpt
from fast_tier import slow_except

STEPS, SAVE_AT, MICRO = 5, (2, 3), 2
CASES = [(stage, dtype, "none") for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16")]
# offload_optimizer placements; the delayed update's warm-up of 2 makes the save after step 2
# happen with no update pending, the one after step 3 with one pending.
PLACEMENTS = {"none": None, "offload": {"device": "cpu", "ratio": 1.0},
              "twin-flow": {"device": "cpu", "ratio": 0.4},
              "delayed": {"device": "cpu", "ratio": 1.0,
                          "delayed_update": {"enabled": True, "warmup_steps": 2}},
              "delayed-twin-flow": {"device": "cpu", "ratio": 0.4,
                                    "delayed_update": {"enabled": True, "warmup_steps": 2}}}
OFFLOAD_CASES = [(stage, dtype, placement) for stage in (1, 2, 3) for dtype in ("fp32", "bf16")
                 for placement in ("offload", "twin-flow", "delayed", "delayed-twin-flow")]


def _config(stage: int, dtype: str, placement: str = "none") -> dict:
    offload = PLACEMENTS[placement]
    return {"train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2,
                                                         "warmup_type": "linear"}},
            "gradient_clipping": 1.0, "bf16": {"enabled": dtype == "bf16"},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000,
                                  **({"stage3_param_persistence_threshold": 100} if stage == 3 else {}),
                                  **({"offload_optimizer": offload} if offload else {})}}


def _dataset(world: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (3 * MICRO * world, 17), generator=g)  # 3 batches per epoch
    return torch.utils.data.TensorDataset(tokens)


def _batches(loader):
    epoch = loader.sampler.epoch
    while True:
        loader.sampler.set_epoch(epoch)
        for (tokens,) in loader:
            yield tokens
        epoch += 1


def _train(engine, loader, steps: int, on_step=None) -> list[float]:
    losses = []
    batches = _batches(loader)
    for _ in range(steps):
        tokens = next(batches)
        noise = (torch.randint(0, 256, tokens.shape) + int(np.random.randint(256)) + random.randrange(256))
        tokens = (tokens + noise) % 256
        loss = engine(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(engine.global_steps)
    return losses


def _seed_everything(rank: int) -> None:
    torch.manual_seed(100 + rank)
    np.random.seed(200 + rank)
    random.seed(300 + rank)


def _resume_cases(rank: int, world: int, root: str, cases: list) -> dict:
    import zerokit

    out = {}
    for stage, dtype, placement in cases:
        ckpt = os.path.join(root, f"s{stage}-{dtype}-{placement}")
        _seed_everything(rank)
        engine, _, loader, _ = zerokit.initialize(model=tiny_gpt(0), config=_config(stage, dtype, placement),
                                                  training_data=_dataset(world))

        def save(step: int) -> None:
            if step in SAVE_AT:
                engine.save_checkpoint(ckpt, client_state={"step": step, "note": [stage, dtype]})
                if placement.startswith("delayed"):  # the update in flight when saved, or none in warm-up
                    assert (engine.offload._worker is not None) == (step > 2), step
        full = _train(engine, loader, STEPS, save)
        final = engine.consolidated_fp32_state_dict()
        engine.destroy()
        for k in SAVE_AT:
            _seed_everything(rank + 50)  # the load must restore the RNG, not the seeds
            engine, _, loader, _ = zerokit.initialize(model=tiny_gpt(1), config=_config(stage, dtype, placement),
                                                      training_data=_dataset(world))
            path, client = engine.load_checkpoint(ckpt, tag=f"global_step{k}", load_rng_states=True)
            # load_rng_states: an exact resume redraws what the uninterrupted run drew (dropout)
            assert path == os.path.join(ckpt, f"global_step{k}")
            assert client == {"step": k, "note": [stage, dtype]}, client
            assert engine.global_steps == k and engine.micro_steps == k
            rest = _train(engine, loader, STEPS - k)
            resumed = engine.consolidated_fp32_state_dict()
            engine.destroy()
            out[(stage, dtype, placement, k)] = (full[k:], rest, final, resumed)
        # `latest` names the newest complete tag.
        with open(os.path.join(ckpt, "latest")) as f:
            assert f.read() == f"global_step{SAVE_AT[-1]}"
    return out


def _check(results: dict) -> None:
    for case, (expected, got, final, resumed) in results.items():
        assert got == expected, f"{case}: losses after resume {got} != uninterrupted {expected}"
        for name, w in final.items():
            assert torch.equal(resumed[name], w), \
                f"{case}: {name} differs after resume (max |diff| {(resumed[name] - w).abs().max()})"


def _run(world: int, cases: list) -> None:
    with tempfile.TemporaryDirectory() as root:
        if world == 1:
            results = [_resume_cases(0, 1, root, cases)]
        else:
            results = run_world(_resume_cases, world, root, cases, timeout=600)
    for r in results:
        _check(r)
        assert len(r) == len(cases) * len(SAVE_AT)


@pytest.mark.parametrize("world", slow_except([1, 2], fast=[1]))
def test_exact_resume(world: int) -> None:
    _run(world, CASES)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_exact_resume_with_offload(world: int) -> None:
    _run(world, OFFLOAD_CASES)
