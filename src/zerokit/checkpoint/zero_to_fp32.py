"""DeepSpeed's zero_to_fp32 helpers for zerokit checkpoints: the fp32 model from the shards.

    from zerokit.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state_dict = get_fp32_state_dict_from_zero_checkpoint("checkpoints")   # tag from `latest`
    model.load_state_dict(state_dict)

Runs offline, on one process, whatever world size and stage saved the checkpoint. Memory: the
whole fp32 model (it returns it), read one saved unit at a time. For a file on disk without
holding the model, use `zerokit convert CKPT_DIR OUT` (zerokit.checkpoint.consolidate.convert).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from zerokit.checkpoint.consolidate import convert, get_fp32_state_dict


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """{name: fp32 tensor} for every parameter (tied aliases included) and persistent buffer."""
    sd = get_fp32_state_dict(checkpoint_dir, tag)
    if exclude_frozen_parameters:
        from zerokit.checkpoint.consolidate import resolve_path
        from zerokit.checkpoint.load import read_meta

        meta = read_meta(resolve_path(checkpoint_dir, tag))
        frozen = {p["name"] for u in meta["units"] if not u["trainable"] for p in u["params"]}
        sd = {k: v for k, v in sd.items() if k not in frozen}
    return sd


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str, tag: str | None = None,
                                         strict: bool = True) -> nn.Module:
    """Load the checkpoint's fp32 weights into a plain (CPU) model and return it, as DeepSpeed does."""
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(sd, strict=strict)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str, tag: str | None = None,
                                               max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """The fp32 model as safetensors in output_dir (sharded + index.json above max_shard_bytes)."""
    return convert(checkpoint_dir, output_dir, torch.float32, tag=tag, max_shard_bytes=max_shard_bytes)
