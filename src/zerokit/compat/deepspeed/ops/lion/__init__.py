"""deepspeed.ops.lion: DeepSpeedCPULion over zerokit.optim.HostLion."""
from __future__ import annotations

from typing import Iterable

from zerokit.compat.deepspeed.ops.adam import _fp32_states_only
from zerokit.optim import HostLion

__all__ = ["DeepSpeedCPULion"]


class DeepSpeedCPULion(HostLion):
    """zerokit.optim.HostLion with DeepSpeedCPULion's signature and defaults."""

    def __init__(self, model_params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, fp32_optimizer_states: bool = True):
        _fp32_states_only(type(self).__name__, fp32_optimizer_states)
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
