"""deepspeed.moe: only the parameter-group helper (zerokit has no expert parallelism)."""
from zerokit.compat.deepspeed.moe import utils

__all__ = ["utils"]
