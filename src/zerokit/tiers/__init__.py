"""Where bytes live (device, host, nvme) and the ledger that counts them."""
from zerokit.tiers.ledger import KINDS, TIERS, Ledger
from zerokit.tier_names import TierName
from zerokit.tiers.tier import CopyHandle, DeviceTier, HostTier, Tier, tiers_for

__all__ = ["KINDS", "TIERS", "Ledger", "Tier", "DeviceTier", "HostTier", "CopyHandle", "tiers_for", "TierName"]
# The nvme tier is zerokit.tiers.nvme (NvmeTier, FileRange): imported where used, so a run with
# nothing on NVMe does not load the I/O engine.
