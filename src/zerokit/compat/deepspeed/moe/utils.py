"""deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer, as a plain
parameter-group helper: zerokit has no expert parallelism, so no parameter is an expert
parameter and the groups come back as they are (normalized to a list of dicts)."""
from __future__ import annotations

from typing import Any

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]


def is_moe_param(param: Any) -> bool:
    """DeepSpeed marks expert parameters with `allreduce = False`."""
    return getattr(param, "allreduce", True) is False


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: int | None = None
                                                         ) -> list[dict]:
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    groups = [dict(g, params=list(g["params"])) for g in param_groups]
    for i, g in enumerate(groups):
        if any(is_moe_param(p) for p in g["params"]):
            raise NotImplementedError(
                f"param group {i} holds expert (MoE) parameters (allreduce=False); expert "
                f"parallelism is not implemented in zerokit")
    return groups
