"""Memory: what training a model costs per rank and tier, before anything is allocated.

`estimate(model, world_size, config, ...)` returns the bytes per tier and ledger kind one rank
allocates (memory/estimate.py, [Note: the estimator's byte rules]); `estimate_grid` does so for
every stage and offload choice, as `zerokit estimate` prints it.
"""
from zerokit.memory.estimate import Estimate, choices, estimate, estimate_grid
from zerokit.memory.sources import SHAPES

__all__ = ["Estimate", "SHAPES", "choices", "estimate", "estimate_grid"]
