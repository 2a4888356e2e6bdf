"""Where bytes live (device, host, nvme) and the ledger that counts them."""
from zerokit.tiers.ledger import KINDS, TIERS, Ledger

__all__ = ["KINDS", "TIERS", "Ledger"]
