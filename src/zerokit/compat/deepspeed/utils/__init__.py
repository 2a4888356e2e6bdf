"""deepspeed.utils: the logger, zero_to_fp32, groups (data parallel), set_z3_leaf_modules."""
from __future__ import annotations

import logging

import torch

from zerokit.compat.deepspeed.utils import groups, zero_to_fp32

# zerokit's logger: DeepSpeed's callers set its level (the HF Trainer does) to control zerokit's output.
logger = logging.getLogger("zerokit")

__all__ = ["groups", "logger", "set_z3_leaf_modules", "zero_to_fp32"]


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list) -> list:
    """DeepSpeed: treat modules of these classes as one ZeRO-3 unit, gathered whole (MoE blocks
    whose experts run data-dependently). Not implemented yet in zerokit."""
    names = [c if isinstance(c, str) else getattr(c, "__name__", repr(c)) for c in leaf_module_classes]
    raise NotImplementedError(
        f"set_z3_leaf_modules({names}): ZeRO-3 leaf modules are not implemented yet (issue "
        f"\"Robustness\"); initialize(model, config, wrap=[...]) makes those classes units, which "
        f"gathers each one whole")
