"""DeepSpeed's deprecated spellings, read as the keys that replaced them (as DeepSpeed does).

Each rename is kept for the start-up report (`ZeroKitConfig.renamed`), so the user learns the
current name once, on rank 0.
"""
from __future__ import annotations

import copy
from typing import Any

from zerokit.config.errors import ConfigError


def _move(section: dict, old: str, new: str, where: str, renamed: list[str],
          convert=lambda v: v) -> None:
    if old not in section:
        return
    value = section.pop(old)
    if new in section and section[new] != convert(value):
        raise ConfigError(f"invalid zerokit config:\n  {where}{old}={value!r} is DeepSpeed's old "
                          f"name for {where}{new}, which is also set ({section[new]!r}): keep {new}")
    section.setdefault(new, convert(value))
    renamed.append(f"{where}{old} -> {where}{new}")


def _offload(value: Any) -> Any:
    """cpu_offload / cpu_offload_param true mean device 'cpu' (false: no offload)."""
    if not isinstance(value, bool):
        raise ConfigError(f"invalid zerokit config:\n  a legacy cpu_offload key must be true or "
                          f"false (got {value!r})")
    return {"device": "cpu"} if value else {"device": "none"}


def rename_legacy(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(raw with DeepSpeed's deprecated keys under their current names, ["old -> new", ...]).

    The caller's dict is not changed."""
    renamed: list[str] = []
    out = copy.copy(raw)
    _move(out, "bfloat16", "bf16", "", renamed)
    zero = out.get("zero_optimization")
    if isinstance(zero, dict):
        zero = out["zero_optimization"] = copy.copy(zero)
        _move(zero, "stage3_gather_fp16_weights_on_model_save",
              "stage3_gather_16bit_weights_on_model_save", "zero_optimization.", renamed)
        _move(zero, "cpu_offload", "offload_optimizer", "zero_optimization.", renamed, _offload)
        _move(zero, "cpu_offload_param", "offload_param", "zero_optimization.", renamed, _offload)
    return (out if renamed else raw), renamed
