"""What the estimator estimates: a model built on the meta device, from one of three sources.

- an `nn.Module` the caller built (its parameters are only read: numels, dtypes, requires_grad);
- a transformers config (`PretrainedConfig`, or a model name/path whose config.json is local):
  the causal-LM built from it on the meta device, so nothing is allocated;
- a built-in shape: the demo GPT and the GPTs of benchmarks/bench_infinity.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from zerokit.models import GPT, GPTConfig

# name -> (n_layer, n_embd, n_head, vocab, block size): `zerokit train`'s demo (`make demo`) and
# bench_infinity.py's models (vocab 32000, seq 128).
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "demo": (4, 192, 6, 256, 128),
    "gpt-125m": (12, 768, 12, 32000, 128),
    "gpt-1b": (24, 1792, 14, 32000, 128),
    "gpt-3b": (32, 2560, 20, 32000, 128),
}


@dataclass
class Source:
    """A model to estimate and how to call it on one micro-batch of token ids."""

    model: nn.Module
    label: str
    vocab: int | None       # token ids in [0, vocab) make the example batch; None: not a LM
    max_seq: int | None     # the longest sequence the model takes (the default sequence length)
    hf: bool = False        # called as model(input_ids=..., labels=...), else model(ids, targets)


def gpt_shape(name: str) -> GPTConfig:
    if name not in SHAPES:
        raise ValueError(f"model shape {name!r} is not a built-in shape; allowed: {sorted(SHAPES)} "
                         f"(or pass an nn.Module or a transformers config)")
    layers, width, heads, vocab, seq = SHAPES[name]
    return GPTConfig(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, block_size=seq)


def source_of(model: Any) -> Source:
    """An nn.Module, a transformers PretrainedConfig, a built-in shape name or a GPTConfig."""
    if isinstance(model, nn.Module):
        cfg = getattr(model, "config", None)
        if isinstance(cfg, GPTConfig):
            return Source(model, type(model).__name__, cfg.vocab_size, cfg.block_size)
        vocab = getattr(cfg, "vocab_size", None)
        return Source(model, type(model).__name__, vocab, _hf_max_seq(cfg), hf=vocab is not None)
    if isinstance(model, GPTConfig):
        with torch.device("meta"):
            return Source(GPT(model), "GPT", model.vocab_size, model.block_size)
    if isinstance(model, str) and model in SHAPES:
        cfg = gpt_shape(model)
        with torch.device("meta"):
            return Source(GPT(cfg), model, cfg.vocab_size, cfg.block_size)
    return _hf_source(model)


def _hf_source(model: Any) -> Source:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
    except ImportError:
        raise ValueError(f"model {model!r} is not an nn.Module, a GPTConfig or a built-in shape "
                         f"({sorted(SHAPES)}), and transformers is not installed to read it as a "
                         f"config") from None
    if isinstance(model, str):
        try:
            model = AutoConfig.from_pretrained(model, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"model {model!r}: not a built-in shape ({sorted(SHAPES)}) and no "
                             f"local transformers config found for it ({e})") from None
    if not isinstance(model, PretrainedConfig):
        raise TypeError(f"model must be an nn.Module, a transformers PretrainedConfig, a GPTConfig "
                        f"or a built-in shape name {sorted(SHAPES)} (got {type(model).__name__})")
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(model)
    return Source(built, f"{type(built).__name__} ({model.model_type})", model.vocab_size,
                  _hf_max_seq(model), hf=True)


def _hf_max_seq(cfg: Any) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
        if isinstance(getattr(cfg, key, None), int):
            return getattr(cfg, key)
    return None
