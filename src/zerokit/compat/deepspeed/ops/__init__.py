"""deepspeed.ops: DeepSpeed's optimizer classes over torch's and zerokit's host optimizers."""
from zerokit.compat.deepspeed.ops import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
