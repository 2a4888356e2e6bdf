"""Activation bytes of one micro-batch, measured by running the forward on the meta device.

What autograd keeps from a forward for its backward is what a step's activations cost: every
tensor saved for backward (torch.autograd.graph.saved_tensors_hooks), counted once per storage
(views share one), parameters left out (they are the weights, counted by the layout). On the
meta device nothing is allocated and shapes are exact; the same hook on a real forward gives the
same count (tests/unit/test_memory_estimate.py compares them).
On the meta device torch's attention dispatch always takes the math path, which saves the
(T x T) attention matrix a GPU's fused kernels never keep; `_FusedAttention` routes
`scaled_dot_product_attention` to the fused kernel's meta implementation instead, so what is
counted is what flash / memory-efficient attention saves (q, k, v, output, logsumexp).
The forward also reports the order in which modules ran: the stage-3 trace the gathered-weights
peak is simulated on (engine/gathered_peak.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _FusedAttention(TorchFunctionMode):
    """scaled_dot_product_attention as the fused kernel (see the module's docstring); a call
    the fused kernel does not take (grouped-query heads, a shape it refuses) runs as it was."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            a = dict(zip(_SDPA_ARGS, args), **kwargs)
            if not a.get("enable_gqa"):
                try:
                    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                        a["query"], a["key"], a["value"], a.get("dropout_p", 0.0),
                        a.get("is_causal", False), attn_mask=a.get("attn_mask"),
                        scale=a.get("scale"))[0]
                except (RuntimeError, TypeError, ValueError):
                    pass
        return func(*args, **kwargs)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def measure_forward(model: nn.Module, inputs: dict, dtype: torch.dtype,
                    modules: list[nn.Module]) -> tuple[int, list[nn.Module]]:
    """(bytes saved for backward by one forward of `inputs`, `modules` in the order they ran).

    The model runs on meta copies of its parameters and buffers in `dtype` (floating ones), so a
    real model is only read, never moved or allocated."""
    meta = {}
    for name, p in model.named_parameters():
        meta[name] = torch.empty_like(p, device="meta",
                                      dtype=dtype if p.is_floating_point() else p.dtype
                                      ).requires_grad_(p.requires_grad)
    for name, b in model.named_buffers():
        meta[name] = torch.empty_like(b, device="meta",
                                      dtype=dtype if b.is_floating_point() else b.dtype)
    weights = {_storage_key(t) for t in meta.values()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in weights:
            saved[key] = t.untyped_storage().nbytes()
        return t

    order: list[nn.Module] = []
    wanted = {id(m) for m in modules}
    hooks = [m.register_forward_pre_hook(lambda mod, _args: order.append(mod))
             for m in {id(m): m for m in modules}.values() if id(m) in wanted]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _FusedAttention():
            functional_call(model, meta, args=(), kwargs=inputs, tie_weights=True, strict=False)
    finally:
        for h in hooks:
            h.remove()
    return sum(saved.values()), order


def token_batch(vocab: int, micro_batch: int, seq: int, hf: bool) -> dict:
    """One micro-batch of token ids (and labels, so the loss's activations count) on meta."""
    del vocab  # the values do not matter on meta; the shape does
    ids = torch.zeros(micro_batch, seq, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids} if hf else {"idx": ids, "targets": ids}
