"""deepspeed.ops: DeepSpeed's optimizer classes over torch's and zerokit's host optimizers, and
`__compatible_ops__` (ops/compatible.py)."""
from zerokit.compat.deepspeed.ops import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]


def __getattr__(name: str):
    # Computed on first access and kept, as DeepSpeed does (edits to the dict persist).
    if name == "__compatible_ops__":
        from zerokit.compat.deepspeed.ops.compatible import compatible_ops

        globals()[name] = compatible_ops()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
