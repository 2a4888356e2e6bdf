"""DeepSpeed's second spelling of a key: its config models accept every aliased field both by
the alias and by the field's own name (pydantic's populate_by_name), so
`zero_optimization.gather_16bit_weights_on_model_save` is
`zero_optimization.stage3_gather_16bit_weights_on_model_save` (Accelerate writes the former).

zerokit's schema and tables use the alias (the spelling DeepSpeed documents); the field name is
read as it before validation. Unlike an old name (config/legacy.py) it is not deprecated, so it is
not reported. tests/unit/test_deepspeed_keys.py checks this table against DeepSpeed 0.19.8's
models: every aliased field there, and nothing else.
"""
from __future__ import annotations

import copy
from typing import Any

from zerokit.config.errors import ConfigError

# DeepSpeed's field name -> the alias zerokit's schema and tables use (both dotted paths).
ALIASES: dict[str, str] = {
    f"zero_optimization.{name}": f"zero_optimization.stage3_{name}" for name in (
        "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
        "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
        "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential")
}


def canonical_path(path: str) -> str:
    """The spelling zerokit's tables use for a DeepSpeed key path."""
    return ALIASES.get(path, path)


def read_aliases(raw: dict[str, Any]) -> dict[str, Any]:
    """raw with every field-name spelling under its alias. Both spellings with different values
    are refused (DeepSpeed would silently keep one). The caller's dict is not changed."""
    out = raw
    for name, alias in ALIASES.items():
        section_key, key = name.split(".")
        _, new_key = alias.split(".")
        section = out.get(section_key)
        if not isinstance(section, dict) or key not in section:
            continue
        if out is raw:
            out = copy.copy(raw)
        section = out[section_key] = copy.copy(section)
        value = section.pop(key)
        if new_key in section and section[new_key] != value:
            raise ConfigError(f"invalid zerokit config:\n  {name}={value!r} and {alias}="
                              f"{section[new_key]!r} are two spellings of one key (DeepSpeed "
                              f"accepts both): set one")
        section[new_key] = value
    return out
