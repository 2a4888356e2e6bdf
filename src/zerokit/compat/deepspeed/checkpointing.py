"""deepspeed.checkpointing: zerokit.activations under DeepSpeed's module path (checkpoint,
configure, is_configured, reset, with DeepSpeed's arguments and meaning)."""
from zerokit.activations import checkpoint, configure, is_configured, reset

__all__ = ["checkpoint", "configure", "is_configured", "reset"]
