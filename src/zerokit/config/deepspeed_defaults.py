"""DeepSpeed's defaults where zerokit's own differ, applied to a config given to
`deepspeed.initialize` (the compatibility layer) before it is loaded.

zerokit's own entry points (`zerokit.initialize`, `zerokit train`) keep zerokit's defaults; a
DeepSpeed script must compute what it computes under DeepSpeed, so under DeepSpeed's API a key
the config leaves out takes DeepSpeed's value (docs/deepspeed.md, "Different from DeepSpeed").
"""
from __future__ import annotations

import json
import os
from typing import Any

# key -> DeepSpeed 0.19.8's default (runtime/constants.py), where zerokit's schema has another.
DEEPSPEED_DEFAULTS: dict[str, Any] = {
    # GRADIENT_CLIPPING_DEFAULT = 1.0; zerokit's own default is 0 (no clipping): see the docs.
    "gradient_clipping": 1.0,
}


def with_deepspeed_defaults(config: Any) -> Any:
    """The config with DeepSpeed's default for every key of DEEPSPEED_DEFAULTS it does not set:
    a dict (a copy; the caller's is unchanged), a JSON path (loaded), or a ZeroKitConfig."""
    from zerokit.config.schema import ZeroKitConfig

    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        with open(config) as f:
            config = json.load(f)
    if isinstance(config, dict):
        missing = {k: v for k, v in DEEPSPEED_DEFAULTS.items() if k not in config}
        return {**config, **missing} if missing else config
    if isinstance(config, ZeroKitConfig):
        missing = {k: v for k, v in DEEPSPEED_DEFAULTS.items() if k not in config.model_fields_set}
        if not missing:
            return config
        updated = config.model_copy(update=missing)
        updated._no_contradictions()  # the checks that read these keys (step_in_backward's)
        return updated
    return config  # anything else: load_config names what it accepts
