"""A Hugging Face GPT-2 (tiny random config) with gradient_checkpointing_enable() trains under
zerokit at every stage like the same model without checkpointing (bit for bit) and like the
one-process reference: torch's checkpoint (non-reentrant, HF's default, and reentrant through
gradient_checkpointing_kwargs) and zerokit's (use_zerokit_checkpoint, host-kept inputs)."""
from __future__ import annotations

import pytest
import torch

from harness import run_world
from reference import global_batches, rank_micro_batch

STEPS, MICRO, LR = 3, 2, 0.5
FLAVORS = (None, "torch", "torch reentrant", "zerokit cpu")


def _gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=256, n_positions=16, n_embd=24, n_layer=2, n_head=3,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    return model.train()


def _enable(model, flavor: str | None) -> dict | None:
    """The model's own switch; returns the config's activation_checkpointing section."""
    import warnings

    from zerokit import activations

    if flavor is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renamed the method
        if flavor == "torch reentrant":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        else:
            model.gradient_checkpointing_enable()
    if flavor == "zerokit cpu":
        assert activations.use_zerokit_checkpoint(model)
        return {"cpu_checkpointing": True}
    return None


def _train(rank: int, world: int) -> dict:
    import zerokit
    from zerokit import activations

    out = {}
    for stage in (0, 1, 2, 3):
        for flavor in FLAVORS:
            activations.configure(None)
            model = _gpt2()
            section = _enable(model, flavor)
            zero = {"stage": stage}
            if stage == 3:
                zero["stage3_param_persistence_threshold"] = 0
            config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": zero,
                      "optimizer": {"type": "SGD", "params": {"lr": LR}}}
            if section:
                config["activation_checkpointing"] = section
            engine, _, _, _ = zerokit.initialize(model=model, config=config)
            kept = activations.STORE.stats["kept"]
            losses = []
            for batch in global_batches(STEPS, MICRO * world):
                x, _ = rank_micro_batch(batch, rank, world, 0, 1)
                loss = engine(input_ids=x, labels=x).loss
                engine.backward(loss)
                engine.step()
                t = loss.detach().view(1).clone()
                torch.distributed.all_reduce(t)
                losses.append(t.item() / world)
            out[stage, flavor] = {"losses": losses, "weights": engine.consolidated_fp32_state_dict(),
                                  "kept": activations.STORE.stats["kept"] - kept,
                                  "uses": getattr(engine.scheduler, "stats", {}).get("uses")}
            engine.destroy()
    return out


@pytest.mark.slow
def test_hf_gpt2_with_gradient_checkpointing_at_every_stage() -> None:
    model = _gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref = []
    for x, _ in global_batches(STEPS, MICRO * 2):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    for r in run_world(_train, 2, timeout=600):
        for (stage, flavor), got in r.items():
            base = r[stage, None]
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref), rtol=1e-5,
                                       atol=1e-6, msg=lambda m: f"stage {stage} {flavor}: {m}")
            for name, w in model.named_parameters():
                torch.testing.assert_close(got["weights"][name], w.detach(), rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"stage {stage} {flavor} {name}: {m}")
                assert torch.equal(got["weights"][name], base["weights"][name]), (
                    f"stage {stage} {flavor}: {name} differs from training without checkpointing")
            if flavor == "zerokit cpu":  # zerokit's function did the checkpointing
                assert got["kept"] == 2 * STEPS, got["kept"]
            assert got["uses"] == base["uses"], (stage, flavor, got["uses"], base["uses"])
