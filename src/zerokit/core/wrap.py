"""Which modules become units, and which parameters go in each.

Default policy: every child of every outermost nn.ModuleList (the transformer blocks of GPT-2,
Llama, nanoGPT ...) is a unit; the parameters left over form the root unit, listed last. Within a
wrapped module, parameters are further split by optimizer param group and by requires_grad, since
a unit's master shard is stepped with one group's hyperparameters and frozen weights have no
gradient or optimizer state. A parameter shared by several modules (tied embedding and head)
belongs to the first unit that holds it, in `named_parameters` order.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch.nn as nn

from zerokit.core.leaf import keep_leaves_whole

WrapPolicy = Callable[[str, nn.Module], bool]


def default_wrap_policy(model: nn.Module) -> list[tuple[str, nn.Module]]:
    chosen: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.ModuleList):
                chosen.extend((f"{path}.{i}", block) for i, block in enumerate(child)
                              if any(True for _ in block.parameters()))
            else:
                visit(path, child)
    visit("", model)
    return chosen


def select_modules(model: nn.Module, wrap: "Iterable[type] | WrapPolicy | None"
                   ) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every wrapped module, outermost only, in registration order."""
    if wrap is None:
        return keep_leaves_whole(model, default_wrap_policy(model))
    if callable(wrap) and not isinstance(wrap, type):
        predicate = wrap
    else:
        classes = tuple(wrap)
        if not all(isinstance(c, type) for c in classes):
            raise TypeError(f"wrap must be a callable(name, module) or module classes (got {wrap!r})")

        def predicate(name: str, module: nn.Module) -> bool:
            return isinstance(module, classes)
    chosen: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(t + ".") for t in taken):
            continue
        if predicate(name, module):
            chosen.append((name, module))
            taken.append(name)
    return keep_leaves_whole(model, chosen)  # see [Note: leaf modules]


def group_parameters(model: nn.Module, wrapped: list[tuple[str, nn.Module]],
                     group_of: dict[int, int]
                     ) -> list[tuple[str, nn.Module, int, bool, list[tuple[str, nn.Parameter]]]]:
    """[(unit name, module, param group index, trainable, [(fqn, param)])] in unit order.

    group_of maps id(param) -> optimizer param-group index; a parameter in no group is frozen.
    """
    owner: dict[int, str] = {}
    for prefix, module in wrapped:
        for p in module.parameters():
            owner.setdefault(id(p), prefix)
    buckets: dict[tuple[str, int, bool], list[tuple[str, nn.Parameter]]] = {}
    modules = dict(wrapped, **{"<root>": model})
    order = [prefix for prefix, _ in wrapped] + ["<root>"]
    for fqn, p in model.named_parameters():  # deduplicated: tied weights appear once
        unit = owner.get(id(p), "<root>")
        trainable = p.requires_grad and id(p) in group_of
        key = (unit, group_of.get(id(p), 0) if trainable else -1, trainable)
        buckets.setdefault(key, []).append((fqn, p))
    result = []
    for unit in order:
        for (name, group, trainable), params in buckets.items():
            if name == unit:
                suffix = "" if trainable and group == 0 else (f"[group{group}]" if trainable else "[frozen]")
                result.append((name + suffix, modules[unit], group, trainable, params))
    return result
