"""Where bytes live (device, host, nvme) and the ledger that counts them."""
from zerokit.tiers.ledger import KINDS, TIERS, Ledger
from zerokit.tiers.nvme import FileRange, NvmeTier
from zerokit.tiers.tier import CopyHandle, DeviceTier, HostTier, Tier, tiers_for

__all__ = ["KINDS", "TIERS", "Ledger", "Tier", "DeviceTier", "HostTier", "CopyHandle", "tiers_for",
           "NvmeTier", "FileRange"]
