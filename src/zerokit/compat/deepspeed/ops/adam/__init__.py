"""deepspeed.ops.adam: FusedAdam (torch.optim.Adam) and DeepSpeedCPUAdam (zerokit.optim.HostAdam),
with DeepSpeed's constructor signatures and defaults."""
from __future__ import annotations

from typing import Iterable

import torch

from zerokit.optim import HostAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


class FusedAdam(torch.optim.Adam):
    """torch.optim.Adam with DeepSpeed's FusedAdam signature: adam_w_mode=True (the default) is
    decoupled weight decay (AdamW). torch picks its multi-tensor implementation on the device."""

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        if amsgrad:
            raise ValueError("FusedAdam(amsgrad=True): DeepSpeed's FusedAdam has no AMSGrad variant; "
                             "use torch.optim.Adam(amsgrad=True)")
        if not bias_correction:
            raise ValueError("FusedAdam(bias_correction=False) is not implemented (torch's Adam "
                             "always corrects the bias); use bias_correction=True")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode)
        # Recorded so that zerokit.initialize, which rebuilds the optimizer over the master shards
        # from this class and its defaults, rebuilds the same decay mode.
        self.defaults.update(adam_w_mode=adam_w_mode, bias_correction=bias_correction)


class DeepSpeedCPUAdam(HostAdam):
    """zerokit.optim.HostAdam (the native host kernel) with DeepSpeedCPUAdam's signature.

    fp32_optimizer_states=False keeps the moments in the parameters' dtype, as DeepSpeed does: in
    an engine with bf16.bf16_master_weights_and_grads, bf16 moments (engine/bf16_state.py)."""

    def __init__(self, model_params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True):
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         adamw_mode=adamw_mode, bias_correction=bias_correction, amsgrad=amsgrad)
        record_state_precision(self, fp32_optimizer_states)


def record_state_precision(optimizer: torch.optim.Optimizer, fp32_optimizer_states: bool) -> None:
    """Kept as an attribute (what DeepSpeed's engine reads) and in the defaults, so that the
    optimizer zerokit.initialize rebuilds over the master shards keeps it."""
    if not isinstance(fp32_optimizer_states, bool):
        raise ValueError(f"fp32_optimizer_states={fp32_optimizer_states!r} must be a bool")
    optimizer.fp32_optimizer_states = fp32_optimizer_states
    optimizer.defaults["fp32_optimizer_states"] = fp32_optimizer_states
