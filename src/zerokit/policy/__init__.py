"""Policies: what is partitioned (the stage) and where each piece lives (placement)."""
from zerokit.policy.partition import PartitionPolicy

__all__ = ["PartitionPolicy"]
