"""deepspeed.accelerator: get_accelerator() over torch's CUDA or the CPU."""
from zerokit.compat.deepspeed.accelerator.real_accelerator import Accelerator, get_accelerator

__all__ = ["Accelerator", "get_accelerator"]
