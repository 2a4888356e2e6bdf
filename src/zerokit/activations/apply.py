"""Checkpoint a model's blocks without editing its code: `apply_activation_checkpointing`, and
Hugging Face models pointed at zerokit's `checkpoint`.

The block's `forward` is replaced on the instance by one that calls `checkpoint(forward, ...)`,
so the module's hooks (zerokit's gather hooks at stage 3) stay outside the checkpoint and run
once, in forward; the recomputation inside backward runs the same forward with the weights the
backward already gathered. Transformers 5 wraps its decoder layers the same way.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch.nn as nn

from zerokit.activations.function import checkpoint
from zerokit.units.wrap import default_wrap_policy

Policy = int | type | tuple | list | Callable[[str, nn.Module], bool] | None


def apply_activation_checkpointing(model: nn.Module, policy: Policy = None) -> list[str]:
    """Checkpoint modules of `model`; returns their qualified names, in order.

    policy: None: every block (each child of an nn.ModuleList, the blocks zerokit makes units);
    an int k: every k-th block (0, k, 2k, ...); a module class or a tuple/list of them: every
    outermost module of those classes; a callable(name, module) -> bool: the outermost modules
    it accepts. A module already checkpointed is not wrapped twice.
    """
    chosen = _select(model, policy)
    if not chosen:
        raise ValueError(f"apply_activation_checkpointing: policy {policy!r} selects no module of "
                         f"{type(model).__name__}")
    for _name, module in chosen:
        if not getattr(module, "_zerokit_checkpointed", False):
            module.forward = functools.partial(checkpoint, module.forward)
            module._zerokit_checkpointed = True
    return [name for name, _ in chosen]


def _select(model: nn.Module, policy: Policy) -> list[tuple[str, nn.Module]]:
    if policy is None or isinstance(policy, int) and not isinstance(policy, bool):
        every = 1 if policy is None else policy
        if every <= 0:
            raise ValueError(f"apply_activation_checkpointing: every k-th block needs k >= 1 "
                             f"(got policy={policy!r})")
        return default_wrap_policy(model)[::every]
    if isinstance(policy, type) or isinstance(policy, (tuple, list)):
        classes = (policy,) if isinstance(policy, type) else tuple(policy)
        if not all(isinstance(c, type) for c in classes):
            raise TypeError(f"apply_activation_checkpointing: policy {policy!r} mixes module "
                            f"classes with other values")
        return _outermost(model, lambda _n, m: isinstance(m, classes))
    if callable(policy):
        return _outermost(model, policy)
    raise TypeError(f"apply_activation_checkpointing: policy must be None, an int k, module "
                    f"classes or a callable(name, module) -> bool (got {policy!r})")


def _outermost(model: nn.Module, accept: Callable[[str, nn.Module], bool]
               ) -> list[tuple[str, nn.Module]]:
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if name and not any(name.startswith(c + ".") for c, _ in chosen) and accept(name, module):
            chosen.append((name, module))
    return chosen


def use_zerokit_checkpoint(model: nn.Module) -> list[str]:
    """Point a Hugging Face model's gradient checkpointing at zerokit's `checkpoint` (so the
    activation_checkpointing options apply); call after `model.gradient_checkpointing_enable()`.
    Returns the names of the modules whose checkpoint function was replaced."""
    names = [name for name, m in model.named_modules() if hasattr(m, "_gradient_checkpointing_func")]
    if not names:
        raise ValueError(f"use_zerokit_checkpoint: {type(model).__name__} has no module with "
                         f"gradient checkpointing enabled; call model.gradient_checkpointing_enable() "
                         f"first")
    for name, m in model.named_modules():
        if name in names:
            m._gradient_checkpointing_func = checkpoint
    return names


def checkpointed(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """The modules among these that apply_activation_checkpointing wrapped."""
    return [m for m in modules if getattr(m, "_zerokit_checkpointed", False)]
