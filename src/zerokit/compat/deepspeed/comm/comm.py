"""deepspeed.comm.comm over torch.distributed.

zerokit runs at world size 1 without any process group; so that scripts written for DeepSpeed
run the same way, get_rank / get_world_size / barrier answer for a world of one when no group
exists (DeepSpeed would require init_distributed first). Collectives take torch's arguments.
"""
from __future__ import annotations

import atexit
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

__all__ = ["ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce", "barrier", "broadcast",
           "destroy_process_group", "get_local_rank", "get_rank", "get_world_group", "get_world_size",
           "init_distributed", "is_available", "is_initialized", "new_group", "reduce_scatter_tensor"]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: datetime.timedelta = DEFAULT_TIMEOUT, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Join the process group the launcher describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    in the environment, or rank= and world_size=), or form a world of one (file rendezvous)
    when neither says anything. Does nothing if a group exists or dist_init_required is False.
    auto_mpi_discovery and verbose are accepted and ignored (no MPI discovery: launch with
    torchrun or anything that sets that environment)."""
    if dist.is_initialized() or dist_init_required is False:
        return
    kwargs = {}
    if rank >= 0 and world_size > 0:
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ and init_method is None:
        # A world of one (no launcher): a file rendezvous, so no TCP port can collide.
        init_method = f"file://{tempfile.mkdtemp(prefix='zerokit-ds-')}/store"
        kwargs.update(rank=0, world_size=1)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
        # As DeepSpeed, passed on (-1: unset): torch's file:// and tcp:// rendezvous read them
        # from these arguments only ("rank parameter missing" otherwise).
        kwargs.update(rank=rank, world_size=world_size)
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    dist.init_process_group(backend, init_method=init_method, timeout=timeout, **kwargs)
    atexit.register(_destroy_at_exit)  # a group alive at interpreter exit makes gloo abort


def _destroy_at_exit() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def is_available() -> bool:
    return dist.is_available()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", get_rank()))


def get_world_group():
    return dist.group.WORLD


def barrier(group=None, async_op: bool = False, device_ids=None):
    if is_initialized():
        return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)
    return None


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    if is_initialized():
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return None


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    if is_initialized():
        return dist.broadcast(tensor, src, group=group, async_op=async_op)
    return None


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, async_op: bool = False):
    if is_initialized():
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    tensor_list[0].copy_(tensor)
    return None


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                           async_op: bool = False):
    if is_initialized():
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
    output_tensor.copy_(input_tensor.view_as(output_tensor))
    return None


def reduce_scatter_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, op=ReduceOp.SUM,
                          group=None, async_op: bool = False):
    if is_initialized():
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
    output_tensor.copy_(input_tensor.view_as(output_tensor))
    return None


def new_group(ranks=None, **kwargs):
    return dist.new_group(ranks, **kwargs)


def destroy_process_group(group=None) -> None:
    dist.destroy_process_group(group)
