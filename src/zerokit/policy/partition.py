"""The ZeRO stage as data: which of optimizer state, gradients and weights are partitioned.

This is the only place a stage number is turned into behaviour; everything else asks the policy.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class PartitionPolicy:
    """
    shard_optimizer: fp32 master weights and optimizer state exist only for this rank's shard
        (stage >= 1); otherwise every rank steps the whole model, as DDP does.
    shard_gradients: gradients are reduce-scattered as backward produces them, at every
        micro-step, and the full-size gradient is freed at once (stage >= 2, and stage 1 without
        accumulation: see `for_accumulation`); otherwise full gradients accumulate locally and
        are reduced once, at the accumulation boundary.
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

    def for_accumulation(self, grad_accum_steps: int) -> "PartitionPolicy":
        """Stage 1 keeps full-size gradients only to accumulate micro-steps without
        communicating. With one micro-step per step every backward is a boundary, so stage 2's
        gradient path computes the same reduction, once per step, without the full-size buffer
        (and without autograd adding into it, and zeroing it, every step: issue #29 measured
        stage 1 slower than stage 2 by that much). Stage 0 keeps its buffer: in fp32 it is the
        master gradient itself."""
        if self.stage == 1 and grad_accum_steps == 1 and not self.shard_gradients:
            return replace(self, shard_gradients=True)
        return self

    def describe(self) -> str:
        parts = [name for name, on in (("optimizer state + master", self.shard_optimizer),
                                       ("gradients", self.shard_gradients),
                                       ("weights", self.shard_weights)) if on]
        why = (" (stage 1 without accumulation: no full-size gradient to accumulate in)"
               if self.stage == 1 and self.shard_gradients else "")
        return (f"ZeRO stage {self.stage}: partitioned: {', '.join(parts)}{why}" if parts
                else "ZeRO stage 0 (DDP): everything replicated, gradients all-reduced")
