"""Policies: what is partitioned (the stage) and where each piece lives (placement)."""
from zerokit.policy.partition import PartitionPolicy
from zerokit.policy.placement import PlacementPolicy

__all__ = ["PartitionPolicy", "PlacementPolicy"]
