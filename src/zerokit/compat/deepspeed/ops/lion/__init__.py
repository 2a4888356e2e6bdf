"""deepspeed.ops.lion: DeepSpeedCPULion over zerokit.optim.HostLion."""
from __future__ import annotations

from typing import Iterable

from zerokit.compat.deepspeed.ops.adam import record_state_precision
from zerokit.optim import HostLion

__all__ = ["DeepSpeedCPULion"]


class DeepSpeedCPULion(HostLion):
    """zerokit.optim.HostLion with DeepSpeedCPULion's signature and defaults."""

    def __init__(self, model_params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, fp32_optimizer_states: bool = True):
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
        record_state_precision(self, fp32_optimizer_states)
