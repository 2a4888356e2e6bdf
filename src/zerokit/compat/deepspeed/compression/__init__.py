"""deepspeed.compression: only the module-path helpers."""
from zerokit.compat.deepspeed.compression import helper

__all__ = ["helper"]
