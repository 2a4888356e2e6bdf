"""deepspeed.runtime.zero.offload_config: the offload enums DeepSpeed code and tests import.

The values are the strings zerokit's config takes for `offload_param.device` and
`offload_optimizer.device`, so `OffloadDeviceEnum.cpu` can be put in a config dict as it is
(a str Enum, as DeepSpeed's).
"""
from __future__ import annotations

from enum import Enum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]


class OffloadDeviceEnum(str, Enum):
    """Where offloaded state lives."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """DeepSpeed's names for the kinds of engine state engine.offload_states() moves."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"
