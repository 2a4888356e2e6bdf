"""Checkpoints convert between fp32 and bf16 master weights / optimizer states (issue #27 point 5):
a checkpoint saved with fp32 states loads into bf16 states rounded once to nearest (what torch's
.to(bfloat16) gives the saved fp32 values), one saved with bf16 states loads into fp32 exactly
(widened), and training continues from either."""
from __future__ import annotations

import tempfile

import torch

from reference import engine_train, global_batches, tiny_gpt
from test_bf16_state import MICRO, _config


def _host_tensors(engine) -> dict:
    out = {}
    for u in engine.units:
        for p in u.parts:
            if p.tier.value == "host":
                out[u.name, "master"] = p.master.detach().clone()
                out.update({(u.name, k): t.clone() for k, t in p.state.items()})
    return out


def _save_then_load(save_cfg: dict, load_cfg: dict):
    import zerokit

    with tempfile.TemporaryDirectory() as root:
        engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config=save_cfg)
        engine_train(engine, global_batches(2, MICRO), 0, 1)
        engine.save_checkpoint(root, tag="t")
        saved = _host_tensors(engine)
        engine.destroy()
        engine, _, _, _ = zerokit.initialize(model=tiny_gpt(5), config=load_cfg)
        engine.load_checkpoint(root, tag="t")
        loaded = _host_tensors(engine)
        losses = engine_train(engine, global_batches(1, MICRO, seed=7), 0, 1)  # training goes on
        engine.destroy()
    assert torch.isfinite(torch.tensor(losses)).all()
    assert saved.keys() == loaded.keys() and saved
    return saved, loaded


def test_fp32_states_load_into_bf16_rounded_once():
    fp32 = _config(2, master=False, states=False)
    saved, loaded = _save_then_load(fp32, _config(2, states=True))
    for key, t in saved.items():
        assert t.dtype == torch.float32 and loaded[key].dtype == torch.bfloat16, key
        assert torch.equal(loaded[key], t.to(torch.bfloat16)), key


def test_bf16_states_load_into_fp32_exactly():
    saved, loaded = _save_then_load(_config(3, states=True), _config(3, master=False, states=False))
    for key, t in saved.items():
        assert t.dtype == torch.bfloat16 and loaded[key].dtype == torch.float32, key
        assert torch.equal(loaded[key], t.float()), key
