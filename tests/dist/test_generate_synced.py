"""Hugging Face generate(synced_gpus=True) at stage 3 with prompts of different lengths per rank
(and different numbers of new tokens, so one rank finishes first and keeps stepping with the
others): every rank finishes, with the tokens a plain one-process model generates."""
from __future__ import annotations

import pytest
import torch

from harness import run_world
from fast_tier import slow_except

pytestmark = pytest.mark.robustness
# transformers is in the `test` extra: a missing one is a broken install, not a skip.
import transformers  # noqa: E402


def _tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=3, n_head=2,
                                  bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _prompt(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(2, 96, (1, 3 + 5 * rank), generator=g)  # lengths 3, 8, 13, ...


def _new_tokens(rank: int) -> int:
    return 4 + 6 * rank  # rank 0 finishes first and must keep joining the others' forwards


def _generate(rank: int, world: int) -> tuple[list[int], int]:
    import zerokit

    model = _tiny_gpt2()
    engine, _, _, _ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "comm_timeout_s": 30,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_prefetch_bucket_size": 50_000}})
    prompt = _prompt(rank)
    with torch.no_grad():
        out = engine.module.generate(prompt, attention_mask=torch.ones_like(prompt),
                                     max_new_tokens=_new_tokens(rank), min_new_tokens=_new_tokens(rank),
                                     do_sample=False, synced_gpus=True)
    # The engine trains on afterwards (the scheduler's recorded order survives generation).
    x = torch.randint(2, 96, (1, 8))
    engine.backward(engine.module(x, labels=x).loss)
    engine.step()
    return out[0].tolist(), engine.scheduler.stats["prefetched"]


@pytest.mark.parametrize("world", slow_except([2, 4], fast=[2]))
def test_generate_synced_gpus_at_stage_3_with_different_prompt_lengths(world: int) -> None:
    results = run_world(_generate, world, timeout=180)
    plain = _tiny_gpt2()
    for rank, (tokens, _prefetched) in enumerate(results):
        prompt = _prompt(rank)
        with torch.no_grad():
            expected = plain.generate(prompt, attention_mask=torch.ones_like(prompt),
                                      max_new_tokens=_new_tokens(rank),
                                      min_new_tokens=_new_tokens(rank), do_sample=False)
        assert len(tokens) == prompt.shape[1] + _new_tokens(rank), tokens
        assert tokens == expected[0].tolist(), (rank, tokens, expected[0].tolist())
    assert any(p > 0 for _, p in results), "stage-3 prefetch never followed the recorded order"
