"""Configuration: DeepSpeed-style JSON in, a validated ZeroKitConfig out."""
from __future__ import annotations

import json
import os
from typing import Any

from pydantic import ValidationError

from zerokit.config.aliases import read_aliases
from zerokit.config.auto import resolve_auto, split_auto
from zerokit.config.errors import ConfigError, describe
from zerokit.config.ignored import IGNORED, Ignored, ignored_settings, strip_undeclared
from zerokit.config.legacy import rename_legacy
from zerokit.config.refused import REFUSED, Refused, check_refused
from zerokit.config.schema import ZeroKitConfig

__all__ = ["ConfigError", "IGNORED", "Ignored", "REFUSED", "Refused", "ZeroKitConfig", "ignored_settings",
           "load_config", "resolve_auto"]


def load_config(config: "ZeroKitConfig | dict[str, Any] | str | os.PathLike | None") -> ZeroKitConfig:
    """Accept a dict, a path to a JSON file, or a ZeroKitConfig."""
    if isinstance(config, ZeroKitConfig):
        return config
    if config is None:
        raise ConfigError("config is required: a dict, a path to a JSON file, or a ZeroKitConfig")
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path) as f:
                config = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except json.JSONDecodeError as e:
            line = e.doc.splitlines()[e.lineno - 1] if e.doc.splitlines()[e.lineno - 1:] else ""
            raise ConfigError(f"config file {path}, line {e.lineno} column {e.colno}: not valid "
                              f"JSON ({e.msg}): {line.strip()!r}") from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"config must be a dict, a JSON path or a ZeroKitConfig (got {type(config).__name__})")
    config, renamed = rename_legacy(read_aliases(config))
    # An "auto" zerokit cannot resolve fails at initialize (resolve_auto), not here: zero.Init
    # reads the HF Trainer's config before the Trainer has filled every "auto" (the scheduler's).
    config, autos, unresolved = split_auto(config)
    config, problems = check_refused(config)
    if problems:
        raise ConfigError("invalid zerokit config:\n  " + "\n  ".join(problems))
    config, ignored = strip_undeclared(config)
    try:
        cfg = ZeroKitConfig.model_validate(config)
    except ValidationError as e:
        raise describe(e, ZeroKitConfig) from None
    cfg._ignored_raw = ignored
    cfg._auto_keys = autos
    cfg._unresolved_auto = unresolved
    cfg._renamed = renamed
    return cfg
