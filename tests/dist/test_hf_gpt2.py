"""A Hugging Face GPT-2 (random small config, no download) trains unchanged under stage 3."""
from __future__ import annotations

import torch

from harness import run_world
from reference import global_batches, rank_micro_batch

STEPS, MICRO, LR = 3, 2, 1e-3


def _gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=256, n_positions=16, n_embd=24, n_layer=2, n_head=3,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    return model


def _loss(model, x, y):
    return model(input_ids=x, labels=y).loss  # HF shifts labels itself


def _train(rank: int, world: int) -> dict:
    import zerokit

    model = _gpt2()
    engine, _, _, _ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    losses = []
    for batch in global_batches(STEPS, MICRO * world):
        x, _ = rank_micro_batch(batch, rank, world, 0, 1)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        t = loss.detach().view(1).clone()
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
    units = [u.name for u in engine.units]
    return {"losses": losses, "weights": engine.consolidated_fp32_state_dict(), "units": units}


def test_hf_gpt2_trains_under_stage3_like_the_reference() -> None:
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)  # DeepSpeed's AdamW default
    ref = []
    for x, _ in global_batches(STEPS, MICRO * 2):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    for r in run_world(_train, 2):
        assert "transformer.h.0" in r["units"] and "transformer.h.1" in r["units"], r["units"]
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref), rtol=1e-5, atol=1e-6)
        for name, w in model.named_parameters():
            torch.testing.assert_close(r["weights"][name], w.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name}: {m}")
