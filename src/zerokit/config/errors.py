"""Turning pydantic's validation errors into messages that name the key, the value and the fix.

An unknown key is the commonest mistake in a DeepSpeed-style JSON (a typo, or a key from a
DeepSpeed feature zerokit does not have): the message names the nearest valid key at that level.
"""
from __future__ import annotations

import copy
import difflib
from typing import Any

from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
    """A configuration that zerokit refuses, with every problem found listed."""


def _model_at(model: type[BaseModel], path: tuple) -> type[BaseModel] | None:
    """The pydantic model class that holds the key at `path` (its parent), if any."""
    current: Any = model
    for part in path[:-1]:
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = current.model_fields.get(part)
        if field is None:
            field = next((f for f in current.model_fields.values() if f.alias == part), None)
        if field is None:
            return None
        current = field.annotation
        # Optional[Model] / Model | None: take the model.
        for arg in getattr(current, "__args__", ()) or ():
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                current = arg
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _valid_keys(model: type[BaseModel]) -> list[str]:
    return sorted(f.alias or name for name, f in model.model_fields.items())


# What a strict type allows, in JSON's words (pydantic says "Input should be a valid boolean").
_ALLOWED = {
    "bool_type": "must be true or false (a JSON boolean; strings and numbers are not converted)",
    "int_type": "must be a whole number (a JSON number; strings and booleans are not converted)",
    "float_type": "must be a number (a JSON number; strings and booleans are not converted)",
}


def describe(error: ValidationError, root: type[BaseModel]) -> ConfigError:
    lines = []
    for item in error.errors():
        loc = tuple(str(p) for p in item["loc"])
        where = ".".join(loc) or "<config>"
        if item["type"] == "extra_forbidden":
            from zerokit.config.ignored import ignored_keys_at

            parent = _model_at(root, loc)
            valid = sorted(_valid_keys(parent) + ignored_keys_at(loc[:-1])) if parent else []
            near = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            lines.append(
                f"unknown key '{where}'{hint} (valid keys here: {', '.join(valid)})"
            )
        else:
            msg = _ALLOWED.get(item["type"], item["msg"])
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
            value = item.get("input")
            shown = "" if isinstance(value, dict) else f" (got {value!r})"
            lines.append(f"{where}: {msg}{shown}")
    return ConfigError("invalid zerokit config:\n  " + "\n  ".join(lines))


def without_key(raw: dict, parts: tuple[str, ...]) -> dict:
    """A copy of the config dict `raw` without the key at path `parts` (the user's dict and its
    other sections are left as given: only the dicts on the path are copied)."""
    out = copy.copy(raw)
    parent = out
    for part in parts[:-1]:
        parent[part] = copy.copy(parent[part])
        parent = parent[part]
    del parent[parts[-1]]
    return out
