"""bf16 master weights and optimizer state (issue #27): DeepSpeed's keys to the placement's
dtypes, checked against what zerokit has wired, and the host parts told how to store and round.

    bf16.bf16_master_weights_and_grads   the master (and the gradient the optimizer reads) bf16
    bf16.bf16_optimizer_states           the optimizer state bf16 too (needs the first)
    DeepSpeedCPUAdam(fp32_optimizer_states=False)
                                         the state in the parameters' dtype: with a bf16 master,
                                         bf16 (DeepSpeed's meaning; cpu_adam.py `state_dtype`)
    bf16.stochastic_rounding (+ _seed)   zerokit: the host kernel rounds bf16 stores
                                         stochastically (zerokit/optim/rounding.py)

Wired on every part kind, stages 1-3: host parts (offload_optimizer device 'cpu'), nvme parts
(device 'nvme': bf16 files, 2 bytes per element each, streamed through the same host kernel) and
the device part (no offload, or Twin-Flow's ratio < 1: the host kernel's math in torch on the
device, optim/device_kernels.py), so a unit's elements get the same bits whichever tier steps
them. What has no bf16 kernel (an optimizer other than Adam/AdamW, Adagrad, Lion; amsgrad) is
torch's optimizer in bf16 on the device part, as in DeepSpeed, and needs bf16 states without
stochastic rounding (parts/executors.py `_bf16_kernel_or_torch`); the host parts refuse it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zerokit.policy import PlacementPolicy

_GOLDEN64 = 0x9E3779B97F4A7C15


def with_state_dtypes(cfg, placement: PlacementPolicy, optimizer: Any) -> PlacementPolicy:
    """`placement` with the master / state dtypes and rounding the config and the optimizer ask
    for; raises where the combination is not wired (or, as in DeepSpeed, not allowed)."""
    b = cfg.bf16
    fp32_states = getattr(optimizer, "fp32_optimizer_states", None)  # DeepSpeedCPU* only
    if not b.bf16_master_weights_and_grads:
        return placement  # fp32 master: fp32_optimizer_states=False keeps fp32 (p.dtype) states
    if b.bf16_optimizer_states and fp32_states is True and placement.offloads:
        # DeepSpeed asserts the same (runtime/base_optimizer.py _configure_master_weights).
        raise ValueError("bf16.bf16_optimizer_states with offload_optimizer needs the client's "
                         f"{type(optimizer).__name__} constructed with fp32_optimizer_states=False "
                         "(as in DeepSpeed), so its moments are stored in bf16")
    bf16_states = b.bf16_optimizer_states or fp32_states is False
    return dataclasses.replace(
        placement, master_dtype=torch.bfloat16,
        state_dtype=torch.bfloat16 if bf16_states else torch.float32,
        stochastic_rounding=b.stochastic_rounding, rounding_seed=b.stochastic_rounding_seed)


def configure_parts(units: list, placement: PlacementPolicy) -> None:
    """Each part's state dtype and rounding arguments (host, nvme and device parts alike), before
    the executors bind (and allocate the state). Each unit draws from its own seed and each
    element from its index in the unit's flat index space, which no world size, Twin-Flow split
    or sub-group changes: a resharded or resumed run rounds with the same bits."""
    for unit in units:
        for part in getattr(unit, "parts", ()):
            part.state_dtype = placement.state_dtype
            if placement.stochastic_rounding:
                seed = (placement.rounding_seed + (unit.index + 1) * _GOLDEN64) % 2**64
                part.rounding = dict(stochastic_rounding=True, seed=seed, index_base=part.lo)

