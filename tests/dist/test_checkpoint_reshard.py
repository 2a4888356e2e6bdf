"""Load into another world size and stage, directly: training continues to match the reference.

Each row trains SAVE_AT steps at (world, stage), saves, loads at (world', stage') and trains the
remaining steps on the same global batches split over world' ranks; the losses of all steps and
the final weights must match the one-process torch reference (fp32 tolerances of test_parity).
"""
from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch

from harness import run_world
from reference import engine_train, global_batches, reference_train, tiny_gpt
from test_checkpoint_resume import PLACEMENTS

STEPS, SAVE_AT, GLOBAL, LR = 5, 2, 4, 1e-3
# (saved world, saved stage) -> (loaded world, loaded stage)
MATRIX = [((2, 1), (4, 2)), ((2, 1), (4, 3)), ((4, 2), (2, 2)), ((2, 2), (1, 0)), ((2, 3), (1, 0))]


def _config(world: int, stage: int, placement: str = "none") -> dict:
    offload = copy.deepcopy(PLACEMENTS[placement])  # callers edit it; the table is shared
    return {"train_micro_batch_size_per_gpu": GLOBAL // world,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
            "gradient_clipping": 1.0, "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000,
                                                            **({"offload_optimizer": offload} if offload else {})}}


def _train(engine, rank: int, world: int, steps: range) -> list[float]:
    batches = global_batches(STEPS, GLOBAL)
    return engine_train(engine, [batches[i] for i in steps], rank, world)


def _phase(rank: int, world: int, root: str, saves: list, loads: list) -> dict:
    """Save from each (stage, placement) of `saves`; load each (source, (stage, placement)) of
    `loads`, where source = (world, stage, placement) of a save, and continue."""
    import zerokit

    out = {}
    for stage, placement in saves:
        engine, _, _, _ = zerokit.initialize(model=tiny_gpt(0), config=_config(world, stage, placement))
        out[("saved", world, stage, placement)] = _train(engine, rank, world, range(SAVE_AT))
        engine.save_checkpoint(os.path.join(root, f"w{world}s{stage}{placement}"))
        engine.destroy()
    for (src_world, src_stage, src_placement), (stage, placement) in loads:
        engine, _, _, _ = zerokit.initialize(model=tiny_gpt(3), config=_config(world, stage, placement))
        engine.load_checkpoint(os.path.join(root, f"w{src_world}s{src_stage}{src_placement}"))
        losses = _train(engine, rank, world, range(SAVE_AT, STEPS))
        out[((src_world, src_stage, src_placement), (world, stage, placement))] = \
            (losses, engine.consolidated_fp32_state_dict())
        engine.destroy()
    return out


def _run(world: int, *args):
    return _phase(0, 1, *args) if world == 1 else run_world(_phase, world, *args, timeout=300)[0]


def check_against_reference(matrix: list, results: dict, atol: float = 1e-6) -> None:
    ref_losses, ref_weights = reference_train(
        tiny_gpt, lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.1),
        global_batches(STEPS, GLOBAL), clip=1.0)
    for src, dst in matrix:
        first = results[("saved", *src)]
        rest, weights = results[(src, dst)]
        torch.testing.assert_close(torch.tensor(first + rest), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{src} -> {dst} losses: {m}")
        for name, w in ref_weights.items():
            torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=atol,
                                       msg=lambda m: f"{src} -> {dst} {name}: {m}")


@pytest.mark.slow
def test_reshard_matrix() -> None:
    results = {}
    with tempfile.TemporaryDirectory() as root:
        results.update(_run(2, root, [(1, "none"), (2, "none"), (3, "none")], []))
        results.update(_run(4, root, [(2, "none")], [((2, 1, "none"), (2, "none")),
                                                     ((2, 1, "none"), (3, "none"))]))
        results.update(_run(2, root, [], [((4, 2, "none"), (2, "none"))]))
        results.update(_run(1, root, [], [((2, 2, "none"), (0, "none")), ((2, 3, "none"), (0, "none"))]))
    check_against_reference([((w, s, "none"), (w2, s2, "none")) for (w, s), (w2, s2) in MATRIX], results)


def test_names_and_shapes_are_checked(tmp_path) -> None:
    """Missing / unexpected keys are named; a shape mismatch names the parameter and both shapes."""
    import zerokit
    from reference import TINY
    from zerokit.models import GPT

    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(0), config=_config(1, 1))
    engine.save_checkpoint(str(tmp_path))
    engine.destroy()

    wider = GPT(type(TINY)(**{**TINY.__dict__, "block_size": 32}))
    engine, _, _, _ = zerokit.initialize(model=wider, config=_config(1, 1))
    with pytest.raises(RuntimeError, match=r"transformer\.wpe\.weight: checkpoint has shape \[16, 24\], "
                                           r"the model has \[32, 24\]"):
        engine.load_checkpoint(str(tmp_path))
    engine.destroy()

    deeper = GPT(type(TINY)(**{**TINY.__dict__, "n_layer": 3}))
    engine, _, _, _ = zerokit.initialize(model=deeper, config=_config(1, 1))
    with pytest.raises(RuntimeError, match=r"missing keys .*transformer\.h\.2\.attn\.c_attn\.weight"):
        engine.load_checkpoint(str(tmp_path))
    # Non-strict: the checkpoint's parameters load, the extra block keeps its values.
    before = engine.module.transformer.h[2].mlp.c_fc.weight.detach().clone()
    engine.load_checkpoint(str(tmp_path), load_module_strict=False, load_optimizer_states=False)
    assert torch.equal(engine.module.transformer.h[2].mlp.c_fc.weight, before)
    assert torch.equal(engine.module.transformer.wte.weight, tiny_gpt(0).transformer.wte.weight)
    engine.destroy()

    shallower = GPT(type(TINY)(**{**TINY.__dict__, "n_layer": 1}))
    engine, _, _, _ = zerokit.initialize(model=shallower, config=_config(1, 1))
    with pytest.raises(RuntimeError, match=r"unexpected keys .*transformer\.h\.1\."):
        engine.load_checkpoint(str(tmp_path))
    engine.destroy()
