"""deepspeed.ops.adagrad: DeepSpeedCPUAdagrad over zerokit.optim.HostAdagrad."""
from __future__ import annotations

from typing import Iterable

from zerokit.compat.deepspeed.ops.adam import record_state_precision
from zerokit.optim import HostAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(HostAdagrad):
    """zerokit.optim.HostAdagrad with DeepSpeedCPUAdagrad's signature (no lr_decay)."""

    def __init__(self, model_params: Iterable, lr: float = 1e-2, eps: float = 1e-10,
                 weight_decay: float = 0.0, amsgrad: bool = False, fp32_optimizer_states: bool = True):
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad(amsgrad=True) has no meaning for Adagrad; use False")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
        record_state_precision(self, fp32_optimizer_states)
