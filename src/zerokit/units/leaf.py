"""Leaf modules: a module whose inside may run differently on each rank, kept whole as one unit.

[Note: leaf modules]
A mixture-of-experts block picks experts from the data, so each rank runs a different subset of
its experts. Split into units (one per expert), the ranks would gather and reduce different units
and the rank agreement would stop them (see [Note: rank agreement]). Marked as a leaf
(`set_leaf_modules(model, [MoEBlock])`, DeepSpeed's `set_z3_leaf_modules`), the module is:

- one unit, never split by the wrap policy (a wrapped module inside a leaf makes the leaf the
  unit instead), so at stage 3 every rank gathers it whole at its entry, whichever experts run;
- reduced at the end of backward, in unit order, on every rank. A unit is otherwise reduced when
  its last gradient arrives, and inside a leaf that moment depends on which experts this rank
  ran (an expert no row chose never gets a gradient), so ranks would reduce units in different
  orders. Its unused experts contribute zeros, as in a single-process run.

The mark is DeepSpeed's attribute (`_z3_leaf`), so a model marked by DeepSpeed's function works
here too. Mark before `zerokit.initialize`: the units are formed there.
"""
from __future__ import annotations

from typing import Iterable

import torch.nn as nn

LEAF_ATTR = "_z3_leaf"  # DeepSpeed's name for the mark


def _matches(module: nn.Module, classes: list) -> bool:
    """A class, or a class name (DeepSpeed accepts both), matches the module's class."""
    return any(type(module).__name__ == c if isinstance(c, str) else isinstance(module, c)
               for c in classes)


def _check_classes(leaf_module_classes: Iterable) -> list:
    classes = list(leaf_module_classes) if not isinstance(leaf_module_classes, (str, type)) \
        else [leaf_module_classes]
    bad = [c for c in classes if not isinstance(c, (str, type))]
    if bad or not classes:
        raise TypeError(f"leaf_module_classes must be a non-empty list of nn.Module classes or "
                        f"class names (got {leaf_module_classes!r})")
    return classes


def set_leaf_modules(model: nn.Module, leaf_module_classes: Iterable) -> list[nn.Module]:
    """Mark every module of these classes (or class names) as a leaf; returns the marked modules.

    Raises ValueError, naming the classes, when the model holds none of them (a misspelt name
    would otherwise leave the model unmarked and fail later, at the first divergent step).
    """
    from zerokit.units.registry import unit_of

    # zero.Init's construction units have no module; an engine's units do.
    if any(getattr(unit_of(p), "module", None) is not None for p in model.parameters()):
        raise RuntimeError("set_leaf_modules: this model's units were already formed by "
                           "zerokit.initialize; mark leaf modules before initialize")
    classes = _check_classes(leaf_module_classes)
    marked = [m for m in model.modules() if _matches(m, classes)]
    if not marked:
        names = [c if isinstance(c, str) else c.__name__ for c in classes]
        raise ValueError(f"set_leaf_modules: no module of class {names} in {type(model).__name__}")
    for m in marked:
        setattr(m, LEAF_ATTR, True)
    return marked


def unset_leaf_modules(model: nn.Module, leaf_module_classes: Iterable) -> list[nn.Module]:
    """Remove the mark from every module of these classes; returns the modules unmarked."""
    classes = _check_classes(leaf_module_classes)
    unmarked = [m for m in model.modules() if _matches(m, classes) and is_leaf(m)]
    for m in unmarked:
        setattr(m, LEAF_ATTR, False)
    return unmarked


def is_leaf(module: nn.Module) -> bool:
    return bool(getattr(module, LEAF_ATTR, False))


def get_leaf_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if is_leaf(m)]


def outermost_leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of each leaf not inside another leaf, in registration order."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if name and is_leaf(module) and not any(name.startswith(n + ".") for n, _ in found):
            found.append((name, module))
    return found


def keep_leaves_whole(model: nn.Module, chosen: list[tuple[str, nn.Module]]
                      ) -> list[tuple[str, nn.Module]]:
    """The wrap policy's choice with leaves made whole: a chosen module inside a leaf gives way
    to the leaf, and a leaf inside no chosen module becomes a unit of its own."""
    leaves = outermost_leaves(model)
    if not leaves:
        return chosen

    def inside(name: str, outer: str) -> bool:
        return name.startswith(outer + ".")
    kept = [(n, m) for n, m in chosen if not any(inside(n, leaf) for leaf, _ in leaves)]
    for leaf, module in leaves:
        if not any(leaf == n or inside(leaf, n) for n, _ in kept):
            kept.append((leaf, module))
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(kept, key=lambda item: order[item[0]])


def leaf_parameter_ids(model: nn.Module) -> set[int]:
    """ids of the parameters inside leaf modules (their units are reduced at end of backward)."""
    return {id(p) for _, m in outermost_leaves(model) for p in m.parameters()}
