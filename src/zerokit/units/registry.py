"""Which unit holds a parameter, for GatheredParameters, zero.Init and the DeepSpeed attributes.

The lookup keeps neither alive: the value is weak, so a dropped engine's units (and their
buffers) are freed, and the key is id(param), which no other object can take while the unit
lives, since the unit holds its parameters. (A WeakKeyDictionary keyed by the parameter would
compare tensors with ==, which is element-wise.)
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from zerokit.units.unit import Unit

_UNIT_OF: "weakref.WeakValueDictionary[int, Unit]" = weakref.WeakValueDictionary()


def unit_of(param: torch.Tensor) -> "Unit | None":
    return _UNIT_OF.get(id(param))


def hold(param: torch.Tensor, unit: "Unit") -> None:
    _UNIT_OF[id(param)] = unit


def let_go(param: torch.Tensor, unit: "Unit") -> None:
    """Forget `param` if `unit` still holds it (a later unit may have taken it over)."""
    if _UNIT_OF.get(id(param)) is unit:
        del _UNIT_OF[id(param)]
