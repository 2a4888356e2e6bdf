"""deepspeed.compression.helper: get and set a submodule by its dotted name."""
from __future__ import annotations

import torch.nn as nn

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: nn.Module, module_name: str) -> nn.Module:
    """model.get_submodule, by DeepSpeed's name: recursive_getattr(model, "encoder.layer.0")."""
    return model.get_submodule(module_name)


def recursive_setattr(model: nn.Module, module_name: str, module: nn.Module) -> None:
    parent, _, last = module_name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, last, module)
