"""The ZeRO stage as data: which of optimizer state, gradients and weights are partitioned.

This is the only place a stage number is turned into behaviour; everything else asks the policy.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PartitionPolicy:
    """
    shard_optimizer: fp32 master weights and optimizer state exist only for this rank's shard
        (stage >= 1); otherwise every rank steps the whole model, as DDP does.
    shard_gradients: gradients are reduce-scattered as backward produces them, at every
        micro-step, and the full-size gradient is freed at once (stage >= 2); otherwise full
        gradients accumulate locally and are reduced once, at the accumulation boundary.
    shard_weights: compute weights are kept only as this rank's shard and gathered around use
        (stage 3).
    """

    stage: int
    shard_optimizer: bool
    shard_gradients: bool
    shard_weights: bool

    @classmethod
    def for_stage(cls, stage: int) -> "PartitionPolicy":
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3 (got {stage!r})")
        return cls(stage, stage >= 1, stage >= 2, stage >= 3)

    def describe(self) -> str:
        parts = [name for name, on in (("optimizer state + master", self.shard_optimizer),
                                       ("gradients", self.shard_gradients),
                                       ("weights", self.shard_weights)) if on]
        return (f"ZeRO stage {self.stage}: partitioned: {', '.join(parts)}" if parts
                else "ZeRO stage 0 (DDP): everything replicated, gradients all-reduced")
