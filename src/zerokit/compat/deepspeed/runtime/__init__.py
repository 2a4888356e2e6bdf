"""deepspeed.runtime: the engine, ZeRO-3 helpers and learning-rate schedules."""
from zerokit.compat.deepspeed.runtime import engine, lr_schedules, zero

__all__ = ["engine", "lr_schedules", "zero"]
