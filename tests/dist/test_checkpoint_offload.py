"""Checkpoints of offloaded engines (offload_optimizer) across placements, world sizes and stages.

Exact resume with offload (same world, stage and placement) is in test_checkpoint_resume.py. Here:
- a checkpoint saved with ZeRO-Offload / Twin-Flow loads without offload, without loads with,
  one ratio into another, into another world size and stage; training continues to match the
  one-process torch reference (test_checkpoint_reshard.py's tolerances);
- the delayed update: a checkpoint saved with an update pending continues the stale-weights
  pipeline at another world size and stage (test_offload.py's one-step-stale reference); loaded
  into an engine without the delayed update it continues from the master (the newest weights);
- a host optimizer whose state does not match the checkpoint's is refused by name.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

from harness import run_world
from reference import global_batches, rank_micro_batch, tiny_gpt
from test_checkpoint_reshard import GLOBAL, STEPS, _config, _run, _train, check_against_reference
from test_offload import stale_reference

# (saved world, stage, placement) -> (loaded world, stage, placement)
MATRIX = [((2, 2, "offload"), (1, 1, "none")),          # offload -> none, fewer ranks
          ((2, 1, "none"), (2, 3, "twin-flow")),        # none -> Twin-Flow, another stage
          ((1, 2, "offload"), (2, 2, "twin-flow")),     # ratio 1 -> 0.4, more ranks
          ((2, 3, "twin-flow"), (4, 2, "offload"))]     # Twin-Flow -> ratio 1, more ranks, stage 3 -> 2


@pytest.mark.slow
def test_offload_reshard_matrix() -> None:
    results = {}
    with tempfile.TemporaryDirectory() as root:
        results.update(_run(1, root, [(2, "offload")], []))
        results.update(_run(2, root, [(2, "offload"), (1, "none"), (3, "twin-flow")],
                            [((2, 1, "none"), (3, "twin-flow")), ((1, 2, "offload"), (2, "twin-flow"))]))
        results.update(_run(1, root, [], [((2, 2, "offload"), (1, "none"))]))
        results.update(_run(4, root, [], [((2, 3, "twin-flow"), (2, "offload"))]))
    check_against_reference(MATRIX, results)


# ---- the delayed update ------------------------------------------------------------------------
DELAY_SAVE_AT, WARMUP = 3, 1  # after 3 steps with a warm-up of 1, an update is pending


def _delayed_config(world: int, stage: int, delayed: bool) -> dict:
    cfg = _config(world, stage, "delayed" if delayed else "offload")
    if delayed:
        cfg["zero_optimization"]["offload_optimizer"]["delayed_update"]["warmup_steps"] = WARMUP
    return cfg


def _delayed_phase(rank: int, world: int, root: str, role: str, stage: int, delayed: bool = True):
    import zerokit

    model = tiny_gpt(0 if role == "save" else 3)
    engine, _, _, _ = zerokit.initialize(model=model, config=_delayed_config(world, stage, delayed))
    if role == "save":
        losses = _train(engine, rank, world, range(DELAY_SAVE_AT))
        assert engine.offload._worker is not None, "no delayed update pending at the save"
        engine.save_checkpoint(root)
        out = (losses, engine.consolidated_fp32_state_dict())
    else:
        engine.load_checkpoint(root)
        loaded = engine.consolidated_fp32_state_dict()
        out = (_train(engine, rank, world, range(DELAY_SAVE_AT, STEPS)), engine.consolidated_fp32_state_dict(),
               loaded)
    engine.destroy()
    return out


def _delayed_run(world: int, *args):
    return _delayed_phase(0, 1, *args) if world == 1 else run_world(_delayed_phase, world, *args, timeout=300)[0]


@pytest.mark.slow
def test_delayed_update_resumes_at_another_world_size_and_stage() -> None:
    with tempfile.TemporaryDirectory() as root:
        first, saved_master = _delayed_run(2, root, "save", 2)
        rest, weights, _ = _delayed_run(1, root, "load", 3)
        # The same checkpoint into an engine without the delayed update: it takes the master.
        plain_rest, _, plain_loaded = _delayed_run(2, root, "load", 1, False)
    ref_losses, ref_weights = stale_reference(global_batches(STEPS, GLOBAL), WARMUP)
    torch.testing.assert_close(torch.tensor(first + rest), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for name, w in ref_weights.items():
        torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    for name, w in saved_master.items():
        assert torch.equal(plain_loaded[name], w), name
    # The plain engine's next forward runs on the master, not on the stale weights in use.
    stale_losses, _ = stale_reference(global_batches(STEPS, GLOBAL), WARMUP)
    assert plain_rest[0] != pytest.approx(stale_losses[DELAY_SAVE_AT], rel=1e-6)


# ---- errors ------------------------------------------------------------------------------------
def test_host_optimizer_mismatch_is_named(tmp_path) -> None:
    import zerokit

    cfg = _config(1, 2, "offload")
    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(0), config=cfg)
    _train(engine, 0, 1, range(1))
    engine.save_checkpoint(str(tmp_path))
    engine.destroy()
    cfg["optimizer"] = {"type": "Adagrad", "params": {"lr": 1e-2}}
    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(0), config=cfg)
    with pytest.raises(ValueError, match=r"optimizer state is \['exp_avg', 'exp_avg_sq'\], this engine's host "
                                         r"optimizer keeps \['sum'\]"):
        engine.load_checkpoint(str(tmp_path))
    engine.load_checkpoint(str(tmp_path), load_optimizer_states=False)  # the weights alone load
    engine.destroy()


def test_offloaded_master_is_stored_whole(tmp_path) -> None:
    """{unit}/master of an offloaded engine = host part then device part: the unit's fp32 weights."""
    import zerokit
    from zerokit.checkpoint.consolidate import get_fp32_state_dict

    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(0), config=_config(1, 2, "twin-flow"))
    assert any(0 < u.host_numel < u.opt_range[1] - u.opt_range[0] for u in engine.units)
    x, y = rank_micro_batch(global_batches(1, GLOBAL)[0], 0, 1, 0, 1)
    engine.backward(engine(x, y))
    engine.step()
    engine.save_checkpoint(str(tmp_path))
    want = engine.consolidated_fp32_state_dict()
    engine.destroy()
    got = get_fp32_state_dict(str(tmp_path), include_buffers=False)
    for name, w in want.items():
        assert torch.equal(got[name], w), name
    assert os.path.isfile(tmp_path / "latest")
