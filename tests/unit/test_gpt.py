"""The built-in GPT (models/gpt.py) as users call it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from zerokit.models import GPT, GPTConfig


def test_targets_sliced_from_one_token_batch_are_accepted() -> None:
    """`x, y = t[:, :-1], t[:, 1:]` is how a batch of block_size + 1 tokens is split; `y` is then
    not contiguous, and the loss must be the one of its values (it raised in view() before)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=8, vocab_size=64))
    t = torch.randint(0, 64, (3, 9))
    x, y = t[:, :-1], t[:, 1:]
    assert not y.is_contiguous()
    loss = model(x, y)
    logits = model(x)
    expected = F.cross_entropy(logits.float().reshape(-1, 64), y.contiguous().reshape(-1))
    assert torch.equal(loss, expected)
