"""ZeRO-Offload's state: the host part of each unit's optimizer range, and moving a unit there.

`place_units` applies a PlacementPolicy to built units: for each unit, the first `host_numel`
elements of its optimizer range get an fp32 master, optimizer state and gradient buffer on the
host tier (a HostShard), and the unit's device `master` / `master_grad` shrink to the rest. The
ledger records both tiers, so the plan and the tests read the bytes that left the device.

Bytes cross twice per step and per unit: the reduced gradient shard device -> host bucket by
bucket as each bucket's reduce-scatter completes (on CUDA: a side stream into a pinned staging
buffer, added on the host when the step needs it), and the new weights host -> device after the host step (16-bit out of the
kernel's fused output where the compute dtype is 16-bit, else the fp32 master itself).
"""
from __future__ import annotations

import threading

import torch
import torch.nn as nn

from zerokit.optim import host as host_kernels
from zerokit.policy import PlacementPolicy

# States per optimizer family, by the names torch uses (so a later checkpoint can share them).
STATE_NAMES = {"adam": ("exp_avg", "exp_avg_sq"), "adagrad": ("sum",), "lion": ("exp_avg",)}


class HostShard:
    """The host part of one unit's optimizer range: master, state, gradient, output buffers."""

    def __init__(self, unit, numel: int, master: torch.Tensor, placement: PlacementPolicy):
        self.unit = unit
        self.numel = numel
        cuda = unit.device.type == "cuda"
        self.pin = placement.pin_memory and cuda and torch.cuda.is_available()
        self.master = self._alloc(torch.float32)
        self.master.copy_(master)
        # With the delayed update the worker reads one gradient buffer while the next backward
        # fills the other; without it one buffer suffices.
        self.grads = [self._alloc(torch.float32).zero_() for _ in range(2 if placement.delayed else 1)]
        self.current = 0
        self.state: dict[str, torch.Tensor] = {}
        self.steps = 0  # host updates applied, the 1-based bias-correction count of the next one
        self.out16 = (self._alloc(unit.compute_dtype, pin=self.pin)
                      if unit.compute_dtype != torch.float32 else None)
        self.staging = self._alloc(torch.float32, pin=True) if cuda else None
        self._staged: list[tuple[torch.cuda.Event, int, int]] = []  # copies in flight
        self.busy: threading.Event | None = None  # set while a worker may write master/state
        led, name = unit.ledger, unit.name
        led.hold(f"{name}/host_master", "master", self.master, tier="host")
        led.hold_bytes(f"{name}/host_grads", "grads", "host", 4 * numel * len(self.grads))
        extra = (self.out16.numel() * self.out16.element_size() if self.out16 is not None else 0) + \
            (4 * numel if self.staging is not None else 0)
        if extra:
            led.hold_bytes(f"{name}/host_buffers", "buffers", "host", extra)

    def _alloc(self, dtype: torch.dtype, pin: bool | None = None) -> torch.Tensor:
        pin = self.pin if pin is None else pin and torch.cuda.is_available()
        return torch.empty(self.numel, dtype=dtype, pin_memory=pin)

    @property
    def grad(self) -> torch.Tensor:
        """The buffer the current backward accumulates into and the next step reads."""
        return self.grads[self.current]

    def init_state(self, family: str, fill: float = 0.0) -> None:
        if self.state:
            return
        for key in STATE_NAMES[family]:
            self.state[key] = torch.full((self.numel,), fill, dtype=torch.float32)
        self.unit.ledger.hold_bytes(f"{self.unit.name}/host_state", "optimizer_state", "host",
                                    4 * self.numel * len(self.state))

    # ---- gradients in ------------------------------------------------------------------------
    def take_grad(self, part: torch.Tensor, offset: int) -> None:
        """Add a reduced gradient bucket (this rank's, averaged) at `offset` of the host gradient."""
        lo, hi = offset, offset + part.numel()
        if part.device.type == "cpu":
            self.grad[lo:hi].add_(part)
            return
        if any(a < hi and lo < b for _, a, b in self._staged):
            self.settle()  # an earlier micro-step's bucket still occupies this staging range
        side = _side_stream(part.device)
        side.wait_stream(torch.cuda.current_stream(part.device))
        with torch.cuda.stream(side):
            self.staging[lo:hi].copy_(part, non_blocking=True)
            part.record_stream(side)
            done = torch.cuda.Event()
            done.record(side)
        self._staged.append((done, lo, hi))

    def settle(self) -> None:
        """Finish the device -> host gradient copies in flight (CUDA) and accumulate them."""
        for done, lo, hi in self._staged:
            done.synchronize()
            self.grad[lo:hi].add_(self.staging[lo:hi])
        self._staged = []

    def grad_sq_norm(self) -> torch.Tensor:
        self.settle()
        total, _finite = host_kernels.grad_sq_norm(self.grad)
        return torch.tensor(total, dtype=torch.float64, device=self.unit.device)

    def zero_grad(self) -> None:
        self.settle()
        self.grad.zero_()

    def swap_grads(self) -> None:
        """Delayed update: the step just launched reads this buffer; backward fills the other."""
        self.current = (self.current + 1) % len(self.grads)
        self.grad.zero_()

    # ---- weights out -------------------------------------------------------------------------
    def wait(self) -> None:
        if self.busy is not None:
            self.busy.wait()

    def master_values(self) -> torch.Tensor:
        self.wait()
        return self.master

    def write_weights(self) -> None:
        """The host part's new weights -> the unit's compute weights (its shard or flat range)."""
        u, k = self.unit, self.numel
        if u.shard is not None:
            dest = u.shard[:k]
        else:
            a = u.opt_range[0]
            dest = u.flat[a:a + k]
        dest.copy_(self.out16 if self.out16 is not None else self.master, non_blocking=self.pin)

    def absorb(self, new: torch.Tensor) -> None:
        """Compute weights were edited: carry changed elements into the host master."""
        self.wait()
        new = new.to("cpu")
        changed = new != self.master.to(new.dtype)
        self.master[changed] = new[changed].float()
        if self.out16 is not None:  # a delayed update's write-back must not undo the edit
            self.out16[changed] = new[changed].to(self.out16.dtype)


_SIDE: dict[torch.device, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


def place_units(units: list, placement: PlacementPolicy) -> list[HostShard]:
    """Move the host part of every trainable unit's optimizer range to the host tier.

    Called before the optimizer is built, so torch's optimizer is built over the device parts.
    """
    shards = []
    for u in units:
        if not u.trainable or u.master is None:
            continue
        a, b = u.opt_range
        k = placement.host_numel(b - a)
        if k == 0:
            continue
        full = u.master.detach()
        home = u.shard if u.shard is not None else u.flat[a:b]
        aliased = full.data_ptr() == home.data_ptr()  # fp32: the master is the weights
        u.host = HostShard(u, k, full[:k].to("cpu"), placement)
        u.host_numel = k
        # A view of the old buffer would keep all of it alive: copy the device part out.
        u.master = nn.Parameter(full[k:] if aliased else full[k:].clone())
        if not aliased:
            u.ledger.hold(f"{u.name}/master", "master", u.master)
        u.master_grad = u.ledger.hold(f"{u.name}/master_grad", "grads",
                                      torch.zeros(b - a - k, dtype=torch.float32, device=u.device))
        u.master.grad = u.master_grad
        shards.append(u.host)
    return shards
