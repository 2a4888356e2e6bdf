"""zerokit: ZeRO for PyTorch models you already have.

    engine, optimizer, dataloader, lr_scheduler = zerokit.initialize(model=model, config=cfg)
    loss = engine(x, y); engine.backward(loss); engine.step()
"""
from zerokit.config import ConfigError, ZeroKitConfig, load_config
from zerokit.core.collectives import CollectiveError
from zerokit.engine.assemble import initialize
from zerokit.engine.engine import Engine
from zerokit.engine.health import NonFiniteError
from zerokit.engine.preemption import PREEMPTED_EXIT_CODE
from zerokit import zero  # noqa: E402  zerokit.zero.GatheredParameters, as deepspeed.zero

__version__ = "0.1.0"
__all__ = ["zero", "CollectiveError", "ConfigError", "Engine", "NonFiniteError", "PREEMPTED_EXIT_CODE",
           "ZeroKitConfig", "initialize", "load_config"]
