"""Which device a rank computes on: one pure function of the facts, so every case is testable
without a GPU.

    choose_device(env, cuda_count, model_device, group)

- a process group someone already created decides: NCCL computes on its bound device (else
  cuda:LOCAL_RANK, else the current CUDA device); any other backend (gloo) computes on the CPU,
  where zerokit's gloo exchanges run (a test harness's gloo group on a GPU machine stays on the CPU);
- under a launcher (RANK and WORLD_SIZE set) on a CUDA machine: cuda:LOCAL_RANK, the device the
  NCCL group zerokit creates is bound to; more local ranks than GPUs is an error naming both;
- without a launcher on a CUDA machine: the CUDA device the model already is on, else the current
  one (cuda:0 unless the user chose another);
- on a machine without CUDA: the CPU, always.

Comm.from_environment applies the choice (torch.cuda.set_device before the process group and any
allocation), for initialize and zero.Init alike, so both pick the same device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch


@dataclass(frozen=True)
class ExistingGroup:
    """A process group initialised before zerokit looked: its backend and bound device, if any."""

    backend: str
    bound_cuda_index: int | None = None


def launched(env: Mapping[str, str]) -> bool:
    """Did a launcher (torchrun, or any that sets RANK and WORLD_SIZE) start this process?"""
    return "RANK" in env and "WORLD_SIZE" in env


def choose_device(env: Mapping[str, str], cuda_count: int, model_device: torch.device | None = None,
                  group: ExistingGroup | None = None,
                  current_cuda_index: int | Callable[[], int] = 0) -> torch.device:
    """The device this rank computes on; raises ValueError for a launch the GPUs cannot serve.

    current_cuda_index may be a function: it is asked only where the answer matters, so under a
    launcher no rank touches cuda:0 before it is told its own GPU.
    """
    if group is not None:
        return _device_of_group(group, env, cuda_count, model_device, current_cuda_index)
    if cuda_count == 0:
        return torch.device("cpu")
    if launched(env):
        return torch.device("cuda", _local_rank_checked(env, cuda_count))
    if model_device is not None and model_device.type == "cuda":
        return _cuda_checked(model_device.index if model_device.index is not None
                             else _current(current_cuda_index), cuda_count, "the model's device")
    return torch.device("cuda", _current(current_cuda_index))


def _current(index: int | Callable[[], int]) -> int:
    return index() if callable(index) else index


def _device_of_group(group: ExistingGroup, env: Mapping[str, str], cuda_count: int,
                     model_device: torch.device | None,
                     current_cuda_index: int | Callable[[], int]) -> torch.device:
    if "nccl" not in group.backend:
        if model_device is not None and model_device.type != "cpu":
            raise ValueError(
                f"the process group's backend is {group.backend!r}: zerokit then computes on the "
                f"CPU, but the model is on {model_device}. Move the model to the CPU, or create "
                f"the process group with backend 'nccl' to train on the GPUs")
        return torch.device("cpu")
    if group.bound_cuda_index is not None:
        index = group.bound_cuda_index
    elif "LOCAL_RANK" in env:
        index = int(env["LOCAL_RANK"])
    else:
        index = _current(current_cuda_index)
    return _cuda_checked(index, cuda_count, "the NCCL process group's device")


def _local_rank_checked(env: Mapping[str, str], cuda_count: int) -> int:
    local_rank = int(env.get("LOCAL_RANK", 0))
    local_world = int(env.get("LOCAL_WORLD_SIZE", local_rank + 1))
    if local_world > cuda_count or local_rank >= cuda_count:
        raise ValueError(
            f"{max(local_world, local_rank + 1)} local ranks (LOCAL_WORLD_SIZE={local_world}, "
            f"LOCAL_RANK={local_rank}) but this machine has {cuda_count} CUDA device(s): each rank "
            f"needs its own GPU. Launch at most {cuda_count} processes per node "
            f"(torchrun --nproc-per-node {cuda_count}), or limit CUDA_VISIBLE_DEVICES accordingly")
    return local_rank


def _cuda_checked(index: int, cuda_count: int, what: str) -> torch.device:
    if not 0 <= index < cuda_count:
        raise ValueError(f"{what} is cuda:{index}, but this machine has {cuda_count} CUDA "
                         f"device(s) (cuda:0 .. cuda:{cuda_count - 1})")
    return torch.device("cuda", index)


def model_device_of(model: torch.nn.Module | None) -> torch.device | None:
    """The device of the model's first parameter (or buffer); None for no model or no tensors."""
    if model is None:
        return None
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return None
