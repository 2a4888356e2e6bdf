"""deepspeed.runtime.engine: DeepSpeedEngine is zerokit's Engine (its DeepSpeed methods live in
zerokit.engine.deepspeed_api)."""
from zerokit.engine.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
