"""deepspeed.utils: the logger, zero_to_fp32, groups (data parallel), leaf modules (set/unset/get_z3_leaf_modules)."""
from __future__ import annotations

import logging

import torch

from zerokit.compat.deepspeed.utils import groups, zero_to_fp32
from zerokit.units.leaf import get_leaf_modules, is_leaf, set_leaf_modules, unset_leaf_modules

# zerokit's logger: DeepSpeed's callers set its level (the HF Trainer does) to control zerokit's output.
logger = logging.getLogger("zerokit")

__all__ = ["get_z3_leaf_modules", "groups", "logger", "set_z3_leaf_modules", "unset_z3_leaf_modules",
           "z3_leaf_module", "zero_to_fp32"]


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list) -> list:
    """DeepSpeed: treat modules of these classes (or class names) as one ZeRO-3 unit, gathered
    whole and reduced at the end of backward (MoE blocks whose experts run data-dependently).
    See [Note: leaf modules] in zerokit/units/leaf.py; mark before initialize."""
    return set_leaf_modules(model, leaf_module_classes)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list) -> list:
    return unset_leaf_modules(model, leaf_module_classes)


def get_z3_leaf_modules(model: torch.nn.Module) -> list:
    return get_leaf_modules(model)


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """DeepSpeed: whether this module is marked as a leaf."""
    return is_leaf(model)
