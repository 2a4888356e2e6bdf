"""deepspeed.checkpoint: checkpoint helpers (see zerokit.checkpoint for the format)."""
from zerokit.compat.deepspeed.checkpoint import utils

__all__ = ["utils"]
