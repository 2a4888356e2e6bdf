"""Which modules become units, and which parameters go in each.

Default policy: every child of every outermost nn.ModuleList (the transformer blocks of GPT-2,
Llama, nanoGPT ...) is a unit; the parameters left over form the root unit, listed last. Within a
wrapped module, parameters are further split by optimizer param group and by requires_grad, since
a unit's master shard is stepped with one group's hyperparameters and frozen weights have no
gradient or optimizer state. A parameter shared by several modules (tied embedding and head)
belongs to the first unit that holds it, in `named_parameters` order.

[Note: tiles]
A tile (each piece of zerokit.zero.TiledLinear / TiledEmbedding, marked with TILE_ATTR) is a unit
of its own, whatever the policy chose around it: a layer larger than the gather budget is then
gathered and released piece by piece at stage 3. So a tile may sit inside a wrapped module (a
transformer block holding a TiledLinear); its parameters belong to the tile's unit, the block's
unit keeps the rest, and each module's hooks gather its own unit. A tile inside a leaf module
gives way to the leaf ([Note: leaf modules]), which must be gathered whole.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch.nn as nn

from zerokit.units.leaf import keep_leaves_whole

WrapPolicy = Callable[[str, nn.Module], bool]
TILE_ATTR = "_zerokit_tile"  # see [Note: tiles]


def is_tile(module: nn.Module) -> bool:
    return bool(getattr(module, TILE_ATTR, False))


def with_tiles(model: nn.Module, chosen: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The policy's choice plus every tile (see [Note: tiles]), in registration order."""
    names = {name for name, _ in chosen}
    tiles = [(n, m) for n, m in model.named_modules() if n and is_tile(m) and n not in names]
    if not tiles:
        return chosen
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(chosen + tiles, key=lambda item: order[item[0]])


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
        return keep_leaves_whole(model, with_tiles(model, default_wrap_policy(model)))
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
    return keep_leaves_whole(model, with_tiles(model, chosen))  # see [Note: leaf modules]


def group_parameters(model: nn.Module, wrapped: list[tuple[str, nn.Module]],
                     group_of: dict[int, int]
                     ) -> list[tuple[str, nn.Module, int, bool, list[tuple[str, nn.Parameter]]]]:
    """[(unit name, module, param group index, trainable, [(fqn, param)])] in unit order.

    group_of maps id(param) -> optimizer param-group index; a parameter in no group is frozen.
    """
    owner: dict[int, str] = {}
    # A module inside another wrapped one (a tile, see [Note: tiles]) claims its parameters first.
    nested = [(n, m) for n, m in wrapped if any(n.startswith(o + ".") for o, _ in wrapped)]
    for prefix, module in nested + [w for w in wrapped if w not in nested]:
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
