"""deepspeed.utils.groups, as far as data parallelism goes: zerokit is data parallel only, so the
data-parallel group is the world. Model, expert and sequence parallel groups do not exist."""
from __future__ import annotations

import torch.distributed as dist

from zerokit.compat.deepspeed import comm

__all__ = ["get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size"]


def _get_data_parallel_group():
    return dist.group.WORLD


def _get_data_parallel_world_size() -> int:
    return comm.get_world_size()


def _get_data_parallel_rank() -> int:
    return comm.get_rank()


get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank


def _get_sequence_parallel_group():
    raise NotImplementedError("sequence parallelism (Ulysses) is not implemented in zerokit")


def _get_expert_parallel_group(group_name: str = ""):
    raise NotImplementedError("expert parallelism (MoE) is not implemented in zerokit")
