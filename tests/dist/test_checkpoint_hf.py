"""A trained transformers GPT-2, consolidated, loads with `GPT2LMHeadModel.from_pretrained`.

Two ways out, as users take them:
- `zerokit convert CKPT OUT` on a checkpoint: the checkpoint keeps the model's config.json
  (transformers models have `model.config`), so OUT loads as it is, fp32 and bf16 alike;
- `engine.save_16bit_model(OUT)`, which writes weights only (as DeepSpeed's does): the user adds
  `model.config.save_pretrained(OUT)`, as DeepSpeed users do.
Either way every parameter equals the trained one, the tied lm_head included, and transformers
reports no missing or unexpected keys.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from harness import run_world
from reference import global_batches, rank_micro_batch
from test_hf_gpt2 import _gpt2

STEPS, MICRO, LR = 3, 2, 1e-2


def _train_and_export(rank: int, world: int, root: str, stage: int, dtype: str) -> dict:
    import zerokit

    model = _gpt2()
    engine, _, _, _ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "bf16": {"enabled": dtype == "bf16"}, "zero_optimization": {"stage": stage}})
    for batch in global_batches(STEPS, MICRO * world):
        x, _ = rank_micro_batch(batch, rank, world, 0, 1)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    engine.save_checkpoint(os.path.join(root, "ckpt"))
    out16 = os.path.join(root, "out16")
    engine.save_16bit_model(out16)
    if rank == 0:
        model.config.save_pretrained(out16)
    trained = engine.consolidated_fp32_state_dict()
    engine.destroy()
    return trained


def _from_pretrained(path: str, dtype: torch.dtype):
    from transformers import GPT2LMHeadModel

    model, info = GPT2LMHeadModel.from_pretrained(path, dtype=dtype, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)}


def _check(loaded: dict, trained: dict, dtype: torch.dtype, what: str) -> None:
    assert loaded["lm_head.weight"].data_ptr() == loaded["transformer.wte.weight"].data_ptr(), what
    for name, w in loaded.items():
        assert w.dtype == dtype, (what, name, w.dtype)
        assert torch.equal(w, trained[name].to(dtype)), f"{what}: {name} differs from the trained weights"


def _convert(root: str, out: str, dtype: str) -> None:
    subprocess.run([sys.executable, "-c", "import sys; from zerokit.cli import main; sys.exit(main())",
                    "convert", os.path.join(root, "ckpt"), out, "--dtype", dtype], check=True)


@pytest.mark.slow
def test_converted_gpt2_loads_with_from_pretrained(tmp_path) -> None:
    for stage, dtype in [(3, "fp32"), (2, "bf16")]:
        root = str(tmp_path / f"s{stage}{dtype}")
        trained = run_world(_train_and_export, 2, root, stage, dtype)[0]
        untrained = dict(_gpt2().named_parameters())
        assert not torch.equal(trained["transformer.h.0.attn.c_attn.weight"],
                               untrained["transformer.h.0.attn.c_attn.weight"])
        for out_dtype, torch_dtype in [("fp32", torch.float32), ("bf16", torch.bfloat16)]:
            out = os.path.join(root, f"converted-{out_dtype}")
            _convert(root, out, out_dtype)
            assert os.path.isfile(os.path.join(out, "config.json"))
            _check(_from_pretrained(out, torch_dtype), trained, torch_dtype, f"convert {stage} {dtype}->{out_dtype}")
        compute = torch.bfloat16 if dtype == "bf16" else torch.float32
        _check(_from_pretrained(os.path.join(root, "out16"), compute), trained, compute,
               f"save_16bit_model {stage} {dtype}")
