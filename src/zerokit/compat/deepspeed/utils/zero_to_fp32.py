"""deepspeed.utils.zero_to_fp32 for zerokit checkpoints (zerokit.checkpoint.zero_to_fp32)."""
from __future__ import annotations

import torch

from zerokit.checkpoint.consolidate import convert
from zerokit.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint"]


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str, tag: str | None = None,
                                               max_shard_size: int = 5 * 2**30, safe_serialization: bool = True,
                                               exclude_frozen_parameters: bool = False) -> list[str]:
    """DeepSpeed's signature over `zerokit convert`: fp32 safetensors in output_dir. zerokit
    writes safetensors only, and all parameters."""
    if not safe_serialization:
        raise ValueError("convert_zero_checkpoint_to_fp32_state_dict(safe_serialization=False): "
                         "zerokit writes safetensors only")
    if exclude_frozen_parameters:
        raise NotImplementedError("convert_zero_checkpoint_to_fp32_state_dict(exclude_frozen_parameters="
                                  "True) is not implemented; use get_fp32_state_dict_from_zero_checkpoint")
    return convert(checkpoint_dir, output_dir, dtype=torch.float32, tag=tag, max_shard_bytes=max_shard_size)
