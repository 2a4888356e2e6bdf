"""Refusing an offload plan the host cannot hold, at start-up, with the numbers.

Offloading moves the fp32 master, the optimizer state and the gradients of each rank's shard
(and with offload_param its weight shard) into host memory, which every rank on a machine
shares. A plan that does not fit used to fail late: the kernel's OOM killer mid-allocation, or a
machine swapping for hours. Before anything is allocated, `check_host_memory` adds up what the
placement will allocate on this rank, multiplies by the ranks on this machine, and compares it
with the memory available (the smaller of the system's and the cgroup's).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import psutil
import torch

from zerokit.engine.optimizer import STATE_BYTES_PER_ELEMENT
from zerokit.policy import PlacementPolicy

GiB = 1 << 30
_CGROUP = "/sys/fs/cgroup"


class HostMemoryError(MemoryError):
    """The offload plan needs more host memory than this machine has available."""


@dataclass
class HostNeed:
    """Host bytes this rank's offload placement allocates, by what they hold."""

    weights: int = 0  # offload_param's weight shards
    master: int = 0
    grads: int = 0
    state: int = 0
    buffers: int = 0  # 16-bit outputs and device staging

    @property
    def total(self) -> int:
        return self.weights + self.master + self.grads + self.state + self.buffers


def plan_host_bytes(units: list, placement: PlacementPolicy, optimizer_kind: str | None, *,
                    weights: bool = True, optimizer: bool = True) -> HostNeed:
    """What place_weight_shards (weights) and place_units, then the optimizer state at bind
    (optimizer), will allocate on the host; mirrors HostShard's buffers (test_host_budget checks
    it against the ledger). An optimizer of unknown kind is counted as Adam (8 bytes)."""
    need = HostNeed()
    state_per_elem = STATE_BYTES_PER_ELEMENT.get(optimizer_kind or "", 8)
    for u in units:
        if weights and placement.params_on_host and u.shard is not None:
            need.weights += u.shard_numel * u.shard.element_size()
        if not (optimizer and placement.offloads) or not u.trainable or u.master is None:
            continue
        a, b = u.opt_range
        k = placement.host_numel(b - a)
        if k == 0:
            continue
        in_place = placement.params_on_host and not placement.delayed and u.shard is not None
        fp32 = u.compute_dtype == torch.float32
        need.master += 0 if in_place and fp32 else 4 * k
        need.grads += 4 * k * (2 if placement.delayed else 1)
        need.state += state_per_elem * k
        if not fp32 and not in_place:
            need.buffers += k * torch.empty(0, dtype=u.compute_dtype).element_size()
        if u.device.type == "cuda":
            need.buffers += 4 * k
    return need


def available_host_bytes() -> tuple[int, str]:
    """(bytes available to this process's machine or container, where the figure comes from)."""
    avail, source = psutil.virtual_memory().available, "system"
    try:
        with open(os.path.join(_CGROUP, "memory.max")) as f:
            limit = f.read().strip()
        with open(os.path.join(_CGROUP, "memory.current")) as f:
            used = int(f.read())
        if limit != "max" and int(limit) - used < avail:
            avail, source = max(0, int(limit) - used), "cgroup memory.max"
    except (OSError, ValueError):
        pass
    return avail, source


def local_ranks() -> int:
    """Ranks sharing this machine's memory (torchrun's LOCAL_WORLD_SIZE; 1 when unknown)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def check_host_memory(need: HostNeed, placement: PlacementPolicy, ranks: int | None = None,
                      available: tuple[int, str] | None = None) -> None:
    """Raises HostMemoryError when `ranks` ranks each allocating `need` cannot fit."""
    if need.total == 0:
        return
    ranks = local_ranks() if ranks is None else ranks
    avail, source = available or available_host_bytes()
    if need.total * ranks <= avail:
        return
    parts = ", ".join(f"{name} {size(getattr(need, name))}"
                      for name in ("weights", "master", "grads", "state", "buffers")
                      if getattr(need, name))
    hints = []
    if placement.offloads:
        hints.append(f"lower zero_optimization.offload_optimizer.ratio (now {placement.ratio:g}) "
                     f"to keep part of the optimizer on the device")
    if placement.delayed:
        hints.append("turn off delayed_update (it doubles the host gradient buffer)")
    hints.append("spread the ranks over more machines")
    raise HostMemoryError(
        f"the offload plan needs {size(need.total)} of host memory per rank ({parts}) x "
        f"{ranks} rank(s) on this machine = {size(need.total * ranks)}, but {size(avail)} is "
        f"available ({source}); " + "; or ".join(hints))


def size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"
