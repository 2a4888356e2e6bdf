"""Activation checkpointing (ZeRO-R), with DeepSpeed's `deepspeed.checkpointing` API:

    zerokit.activations.configure(mpu, deepspeed_config=cfg)   # or checkpoint_in_cpu=True, ...
    y = zerokit.activations.checkpoint(block, x)               # recomputed in backward
    zerokit.activations.apply_activation_checkpointing(model)  # every block, no model edits

The options (partitioned across a model-parallel group, kept in host memory, in contiguous
buffers) are the config's `activation_checkpointing` section; see [Note: kept activations] in
store.py. `initialize` configures them from the engine's config and counts the kept bytes in the
engine's ledger (kind "activations").
"""
from zerokit.activations.apply import apply_activation_checkpointing, use_zerokit_checkpoint
from zerokit.activations.function import checkpoint
from zerokit.activations.options import SETTINGS, Options, configure, is_configured, timings, use_ledger
from zerokit.activations.store import STORE


def reset() -> None:
    """Free the kept checkpoints and contiguous buffers (DeepSpeed's reset(): call it after
    forwards that had no backward, as evaluation with contiguous_memory_optimization)."""
    STORE.reset()


def options() -> Options:
    return SETTINGS.options


__all__ = ["Options", "apply_activation_checkpointing", "checkpoint", "configure", "is_configured",
           "options", "reset", "timings", "use_ledger", "use_zerokit_checkpoint"]
