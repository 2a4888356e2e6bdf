"""zerokit: ZeRO for PyTorch models you already have."""
__version__ = "0.1.0"
