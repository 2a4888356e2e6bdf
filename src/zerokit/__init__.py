"""zerokit: ZeRO for PyTorch models you already have.

    engine, optimizer, dataloader, lr_scheduler = zerokit.initialize(model=model, config=cfg)
    loss = engine(x, y); engine.backward(loss); engine.step()

The engine's names below are imported on first use (PEP 562), so that importing a part of
zerokit (`zerokit.checkpoint`, `zerokit.config`, `zerokit.io`) does not import the engine.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zerokit.config import ConfigError, ZeroKitConfig, load_config
from zerokit.comm.collectives import CollectiveError
from zerokit import zero  # noqa: E402  zerokit.zero.GatheredParameters, as deepspeed.zero

__version__ = "0.1.0"

# public name -> (module, attribute)
_LAZY = {
    "initialize": ("zerokit.engine.assemble", "initialize"),
    "Engine": ("zerokit.engine.engine", "Engine"),
    "NonFiniteError": ("zerokit.engine.health", "NonFiniteError"),
    "EngineFailedError": ("zerokit.states", "EngineFailedError"),
    "PREEMPTED_EXIT_CODE": ("zerokit.engine.preemption", "PREEMPTED_EXIT_CODE"),
}
__all__ = ["zero", "CollectiveError", "ConfigError", "Engine", "EngineFailedError", "NonFiniteError", "PREEMPTED_EXIT_CODE",
           "ZeroKitConfig", "initialize", "load_config"]

if TYPE_CHECKING:
    from zerokit.engine.assemble import initialize
    from zerokit.engine.engine import Engine
    from zerokit.states import EngineFailedError
    from zerokit.engine.health import NonFiniteError
    from zerokit.engine.preemption import PREEMPTED_EXIT_CODE


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'zerokit' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
