"""zerokit: ZeRO for PyTorch models you already have.

    engine, optimizer, dataloader, lr_scheduler = zerokit.initialize(model=model, config=cfg)
    loss = engine(x, y); engine.backward(loss); engine.step()

The names below are imported on first use (PEP 562), so that importing a part of zerokit
(`zerokit.checkpoint`, `zerokit.config`, `zerokit.io`) does not import the engine.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> (module, attribute); attribute None: the module itself
_LAZY = {
    "ConfigError": ("zerokit.config", "ConfigError"),
    "ZeroKitConfig": ("zerokit.config", "ZeroKitConfig"),
    "load_config": ("zerokit.config", "load_config"),
    "CollectiveError": ("zerokit.core.collectives", "CollectiveError"),
    "initialize": ("zerokit.engine.assemble", "initialize"),
    "Engine": ("zerokit.engine.engine", "Engine"),
    "NonFiniteError": ("zerokit.engine.health", "NonFiniteError"),
    "PREEMPTED_EXIT_CODE": ("zerokit.engine.preemption", "PREEMPTED_EXIT_CODE"),
    "zero": ("zerokit.zero", None),  # zerokit.zero.GatheredParameters, as deepspeed.zero
}
__all__ = ["zero", "CollectiveError", "ConfigError", "Engine", "NonFiniteError", "PREEMPTED_EXIT_CODE",
           "ZeroKitConfig", "initialize", "load_config"]

if TYPE_CHECKING:
    from zerokit import zero
    from zerokit.config import ConfigError, ZeroKitConfig, load_config
    from zerokit.core.collectives import CollectiveError
    from zerokit.engine.assemble import initialize
    from zerokit.engine.engine import Engine
    from zerokit.engine.health import NonFiniteError
    from zerokit.engine.preemption import PREEMPTED_EXIT_CODE


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'zerokit' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
