"""Config keys zerokit accepts and does not act on, each with the reason, reported at start-up.

A DeepSpeed config carries keys for features zerokit does not have, or that zerokit's design makes
moot. Refusing them would make existing configs fail; dropping them silently would let a user
believe they act. So each such key is one line of `IGNORED` (its dotted path -> why), and
`initialize` reports the ones a config sets, once, on rank 0, through the "zerokit" logger.

- A path the schema declares (`zero_optimization.contiguous_gradients`) is validated as usual
  (type, range) and reported when the config sets it to a value outside `honoured`, the values
  that describe what zerokit always does anyway.
- A path the schema does not declare (DeepSpeed's `tensorboard`, `wandb`, ...) is accepted with
  any value: `strip_undeclared` removes it before validation, and it is reported whenever set.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zerokit.config.schema import ZeroKitConfig


@dataclass(frozen=True)
class Ignored:
    reason: str
    honoured: tuple = ()  # values zerokit acts on anyway: setting one of these is not reported


IGNORED: dict[str, Ignored] = {
    "zero_optimization.contiguous_gradients": Ignored(
        "zerokit always copies a unit's gradients into one contiguous buffer as they are produced "
        "(the unit's flat layout); false cannot turn that off", honoured=(True,)),
    "zero_optimization.reduce_scatter": Ignored(
        "zerokit always reduce-scatters gradients where they are partitioned (stages 1-3) and "
        "all-reduces them at stage 0; DeepSpeed's false (all-reduce everywhere) averages the same "
        "values with more traffic", honoured=(True,)),
    "zero_optimization.allgather_bucket_size": Ignored(
        "DeepSpeed uses it only where torch lacks all_gather_into_tensor (no torch zerokit "
        "supports) and not at stage 3; zerokit all-gathers each unit in place into the unit's own "
        "buffer, so there is no staging buffer for it to bound (stage 3 gathers are bounded by "
        "stage3_prefetch_bucket_size and stage3_max_live_parameters)"),
}


def _split(path: str) -> tuple[str, ...]:
    return tuple(path.split("."))


def _declared(path: tuple[str, ...]) -> bool:
    from zerokit.config.compat import _model_at
    from zerokit.config.schema import ZeroKitConfig

    parent = _model_at(ZeroKitConfig, path)
    return parent is not None and any(
        path[-1] in (name, f.alias) for name, f in parent.model_fields.items())


def strip_undeclared(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(raw without the IGNORED keys the schema does not declare, {path: value} of those).

    The caller's dict is not changed: the sections on a removed key's path are copied."""
    removed: dict[str, Any] = {}
    out = raw
    for path in IGNORED:
        parts = _split(path)
        if _declared(parts):
            continue
        parent = out
        for part in parts[:-1]:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if not isinstance(parent, dict) or parts[-1] not in parent:
            continue
        if out is raw:
            out = copy.copy(raw)
        parent = out
        for part in parts[:-1]:  # copy each section on the way, then remove the key from the copy
            parent[part] = copy.copy(parent[part])
            parent = parent[part]
        removed[path] = parent.pop(parts[-1])
    return out, removed


def ignored_keys_at(path: tuple[str, ...]) -> list[str]:
    """The undeclared IGNORED keys directly under `path` (for unknown-key suggestions)."""
    return [p[-1] for p in map(_split, IGNORED) if p[:-1] == path and not _declared(p)]


def ignored_settings(cfg: "ZeroKitConfig") -> list[tuple[str, Any, str]]:
    """(path, value, reason) for every IGNORED key this config sets, in the table's order."""
    removed = cfg.ignored_raw
    found = []
    for path, entry in IGNORED.items():
        if path in removed:
            found.append((path, removed[path], entry.reason))
            continue
        section: Any = cfg
        parts = _split(path)
        for part in parts[:-1]:
            section = getattr(section, part, None)
        if section is None or parts[-1] not in getattr(section, "model_fields_set", ()):
            continue  # not set by the config (a default is zerokit's own choice)
        value = getattr(section, parts[-1])
        if value not in entry.honoured:
            found.append((path, value, entry.reason))
    return found


def format_ignored(found: list[tuple[str, Any, str]]) -> str:
    lines = ["config keys accepted and ignored:"]
    lines += [f"  {path}={value!r}: {reason}" for path, value, reason in found]
    return "\n".join(lines)
