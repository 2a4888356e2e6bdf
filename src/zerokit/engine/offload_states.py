"""engine.offload_states() / engine.reload_states(): DeepSpeed's API for loops that share the
accelerator between training and inference (RLHF): every state the engine keeps on the device
goes to host memory, and comes back bit for bit.

[Note: offloaded states]
What moves is storage, not tensors: each device buffer's bytes are copied to a host tensor and
its storage is resized to zero, then resized back and refilled on reload. Every view of it
(parameters' `.data`, gradient views, aliases such as fp32 training's master-is-the-weights, the
torch optimizer's references) therefore stays the same object and sees the same bytes after the
round trip, and the device memory is really returned in between. The ledger's device counts move
to the host tier and back, so `ledger.bytes("device")` reads 0 in between.

DeepSpeed's state types pick what moves (a storage moves if any tensor on it is included):
lp_params (the 16-bit weights, gathered or sharded, and the module's buffers), hp_params (the
fp32 masters), lp_grads (the gradient buffers), contiguous_grad_buffer (the reduced gradient
shards) and optim_states (the optimizer's state). As in DeepSpeed, the states an offloaded
optimizer already keeps on the host (offload_optimizer) are not device states and stay where
they are. Training, saving or loading while offloaded is refused until reload_states().
The ledger moves its counts with an offload of every type (the default); with `include` naming
only some, the bytes move but the ledger keeps counting them on the device (a ledger entry is
not labelled with DeepSpeed's state types): a known gap.
"""
from __future__ import annotations

import enum
from typing import Any, Container

import torch

STATE_TYPES = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")

# unit layout record -> DeepSpeed state type (policy/layout.py names the records)
_RECORD_TYPE = {"weights": "lp_params", "shard": "lp_params", "master": "hp_params",
                "grads": "lp_grads", "grad_acc": "lp_grads", "master_grad": "contiguous_grad_buffer"}


def _name(value: Any, what: str, allowed: tuple[str, ...]) -> str:
    name = value.value if isinstance(value, enum.Enum) else value
    if name not in allowed:
        raise ValueError(f"offload_states: {what}={value!r} is not one of {list(allowed)}")
    return name


def device_buffers(engine: Any) -> list[tuple[str, torch.Tensor]]:
    """(state type, tensor) for every buffer the engine holds on the device tier."""
    found: list[tuple[str, torch.Tensor]] = []
    for u in engine.units:
        tensors = {"weights": u.flat, "shard": u.shard, "grads": u.grad_flat, "grad_acc": u.grad_acc,
                   "master": u.master.data if u.master is not None else None, "master_grad": u.master_grad}
        for r in u.layout.records:
            t = tensors.get(r.name)
            if r.tier == "device" and r.name in _RECORD_TYPE and t is not None:
                found.append((_RECORD_TYPE[r.name], t))
    for state in engine.optimizer.state.values():
        found += [("optim_states", v) for v in state.values() if torch.is_tensor(v) and v.numel() > 1]
    found += [("lp_params", b) for b in engine.module.buffers()]
    return found


class StatesOffload:
    """The storages one offload_states() moved to the host, and how to bring them back."""

    def __init__(self, engine: Any, include: Container | None, pin_memory: bool, non_blocking: bool):
        types = set(STATE_TYPES) if include is None else \
            {_name(x, "include", STATE_TYPES) for x in include}
        self.moved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        seen: set[int] = set()
        storages = []
        for kind, t in device_buffers(engine):
            s = t.untyped_storage()
            if kind in types and s.nbytes() and id(s) not in seen:
                seen.add(id(s))
                storages.append(s)
        for s in storages:
            bytes_view = torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)
            pin = pin_memory and bytes_view.is_cuda
            host = torch.empty(bytes_view.shape, dtype=torch.uint8, pin_memory=pin)
            host.copy_(bytes_view, non_blocking=non_blocking and pin)
            self.moved.append((s, host))
        if any(h.is_pinned() for _, h in self.moved) and non_blocking:
            torch.cuda.current_stream().synchronize()  # the copies read what resize_ frees next
        for s, _ in self.moved:
            s.resize_(0)
        # Everything the device tier counted is on the host now; undone by reload.
        self._undo = engine.ledger.relocate("device", "host") if types == set(STATE_TYPES) else None

    def reload(self, non_blocking: bool) -> None:
        for s, host in self.moved:
            s.resize_(host.numel())
            torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).copy_(
                host, non_blocking=non_blocking and host.is_pinned())
        if self._undo is not None:
            self._undo()
        self.moved.clear()


class OffloadStatesAPI:
    """The engine's offload_states / reload_states (see [Note: offloaded states])."""

    _states_offload: StatesOffload | None = None

    def offload_states(self, include: Container | None = None, device: Any = "cpu",
                       pin_memory: bool = True, non_blocking: bool = False) -> None:
        """DeepSpeed's signature: include (OffloadStateTypeEnum members or their names; None:
        all), device ("cpu"; "none" does nothing, as DeepSpeed), pin_memory, non_blocking."""
        where = _name(device, "device", ("cpu", "none", "nvme"))
        if where == "nvme":
            raise NotImplementedError("offload_states(device='nvme'): zerokit moves the engine's "
                                      "states to host memory only (device='cpu'), as DeepSpeed")
        if where == "none":
            return
        if self._states_offload is not None:
            raise RuntimeError("offload_states: the states are already offloaded; call "
                               "reload_states() first")
        self.wait_for_weights()  # nothing in flight may write into what is moved
        self._states_offload = StatesOffload(self, include, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what offload_states moved (a no-op when nothing is offloaded)."""
        if self._states_offload is not None:
            self._states_offload.reload(non_blocking)
            self._states_offload = None
            if non_blocking and torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()

    def _require_states_loaded(self, what: str) -> None:
        if self._states_offload is not None:
            raise RuntimeError(f"engine.{what}: the engine's states are offloaded "
                               f"(offload_states()); call engine.reload_states() first")
