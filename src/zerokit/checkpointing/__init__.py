"""Activation checkpointing (ZeRO-R), with DeepSpeed's `deepspeed.checkpointing` API:

    zerokit.checkpointing.configure(mpu, deepspeed_config=cfg)   # or checkpoint_in_cpu=True, ...
    y = zerokit.checkpointing.checkpoint(block, x)               # recomputed in backward
    zerokit.checkpointing.apply_activation_checkpointing(model)  # every block, no model edits

The options (partitioned across a model-parallel group, kept in host memory, in contiguous
buffers) are the config's `activation_checkpointing` section; see [Note: kept activations] in
store.py. `initialize` configures them from the engine's config and counts the kept bytes in the
engine's ledger (kind "activations").
"""
from zerokit.checkpointing.apply import apply_activation_checkpointing, use_zerokit_checkpoint
from zerokit.checkpointing.function import checkpoint
from zerokit.checkpointing.options import SETTINGS, Options, configure, is_configured, timings, use_ledger
from zerokit.checkpointing.store import STORE


def reset() -> None:
    """Free the kept checkpoints and contiguous buffers (DeepSpeed's reset(): call it after
    forwards that had no backward, as evaluation with contiguous_memory_optimization)."""
    STORE.reset()


def options() -> Options:
    return SETTINGS.options


__all__ = ["Options", "apply_activation_checkpointing", "checkpoint", "configure", "is_configured",
           "options", "reset", "timings", "use_ledger", "use_zerokit_checkpoint"]
