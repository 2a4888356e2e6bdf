"""ZeRO-Offload's state: the host part of each unit's optimizer range, and moving a unit there;
and (offload_param, stage 3) moving each unit's weight shard to the host.

`place_units` applies a PlacementPolicy to built units: for each unit, the first `host_numel`
elements of its optimizer range get an fp32 master, optimizer state and gradient buffer on the
host tier (a HostShard), and the unit's device `master` / `master_grad` shrink to the rest. The
ledger records both tiers, so the plan and the tests read the bytes that left the device.

Bytes cross twice per step and per unit: the reduced gradient shard device -> host bucket by
bucket as each bucket's reduce-scatter completes (on CUDA: a side stream into a pinned staging
buffer, added on the host when the step needs it), and the new weights host -> device after the host step (16-bit out of the
kernel's fused output where the compute dtype is 16-bit, else the fp32 master itself).

With offload_param the weight shard is itself on the host, so the new weights stay there: without
the delayed update the kernel writes them straight into the shard (its `out16`, or in fp32 its
master, *is* the shard's range); with it they are copied in when the update is joined, because the
next forward gathers from the shard while the worker is still writing.
"""
from __future__ import annotations

import threading
import weakref

import torch
import torch.nn as nn

from zerokit.optim import host as host_kernels
from zerokit.policy import PlacementPolicy
from zerokit.tiers.transfer import side_stream

# States per optimizer family, by the names torch uses (so a later checkpoint can share them).
STATE_NAMES = {"adam": ("exp_avg", "exp_avg_sq"), "adagrad": ("sum",), "lion": ("exp_avg",)}


class HostShard:
    """The host part of one unit's optimizer range: master, state, gradient, output buffers."""

    def __init__(self, unit, numel: int, master: torch.Tensor, placement: PlacementPolicy,
                 home: torch.Tensor | None = None):
        """home: host weights the update may write in place (offload_param without delay)."""
        self._unit = weakref.ref(unit)  # the unit holds us: a strong link back would be a cycle
        self.numel = numel
        cuda = unit.device.type == "cuda"
        self.pin = placement.pin_memory and cuda and torch.cuda.is_available()
        fp32_home = home is not None and home.dtype == torch.float32
        self.master = home if fp32_home else self._alloc(torch.float32)  # fp32: the weights
        if not fp32_home:
            self.master.copy_(master)
        # With the delayed update the worker reads one gradient buffer while the next backward
        # fills the other; without it one buffer suffices.
        self.grads = [self._alloc(torch.float32).zero_() for _ in range(2 if placement.delayed else 1)]
        self.current = 0
        self.state: dict[str, torch.Tensor] = {}
        self.steps = 0  # host updates applied, the 1-based bias-correction count of the next one
        if unit.compute_dtype == torch.float32:
            self.out16 = None
        else:
            self.out16 = home if home is not None else self._alloc(unit.compute_dtype, pin=self.pin)
        self.staging = self._alloc(torch.float32, pin=True) if cuda else None
        self._staged: list[tuple[torch.cuda.Event, int, int]] = []  # copies in flight
        self.busy: threading.Event | None = None  # set while a worker may write master/state
        led, name = unit.ledger, unit.name
        # Bytes that are the weight shard are counted once, as weights.
        led.hold_bytes(f"{name}/host_master", "master", "host", 0 if fp32_home else 4 * numel)
        led.hold_bytes(f"{name}/host_grads", "grads", "host", 4 * numel * len(self.grads))
        extra = (self.out16.numel() * self.out16.element_size()
                 if self.out16 is not None and home is None else 0) + \
            (4 * numel if self.staging is not None else 0)
        if extra:
            led.hold_bytes(f"{name}/host_buffers", "buffers", "host", extra)

    @property
    def unit(self):
        return self._unit()

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
        side = side_stream(part.device)
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
        """Delayed update: the step just launched reads this buffer; backward fills the other
        (zeroed by the engine's zero_grad at the end of the same step: not twice)."""
        self.current = (self.current + 1) % len(self.grads)

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
        src = self.out16 if self.out16 is not None else self.master
        if src.data_ptr() != dest.data_ptr():  # else the kernel wrote the shard in place
            dest.copy_(src, non_blocking=self.pin)

    def absorb(self, new: torch.Tensor) -> None:
        """Compute weights were edited: carry changed elements into the host master."""
        self.wait()
        new = new.to("cpu")
        changed = new != self.master.to(new.dtype)
        self.master[changed] = new[changed].float()
        if self.out16 is not None:  # a delayed update's write-back must not undo the edit
            self.out16[changed] = new[changed].to(self.out16.dtype)


def place_weight_shards(units: list, placement: PlacementPolicy) -> None:
    """offload_param: move every stage-3 unit's persistent weight shard to the host tier.

    Gathering then copies the shard host -> device into the unit's slot of its gathered buffer
    before the all-gather (Unit.gather), so the scheduler's prefetch fetches ahead; the step's new
    weights land back in the host shard (Unit.publish_weights, HostShard.write_weights). In fp32
    the optimizer's master was the device shard itself: it stays on the device, as the master.
    """
    pin = placement.param_pin_memory and torch.cuda.is_available() and \
        any(u.device.type == "cuda" for u in units)
    for u in units:
        if u.shard is None:
            continue
        device_shard = u.shard
        u.shard = torch.empty(u.shard_numel, dtype=device_shard.dtype, pin_memory=pin)
        u.shard.copy_(device_shard)
        u.ledger.hold(f"{u.name}/weights", "weights", u.shard, tier="host")
        if u.master is not None and u.master.data_ptr() == device_shard.data_ptr():
            u.ledger.hold(f"{u.name}/master", "master", u.master)


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
        # offload_param without the delay: the host update writes the host shard in place.
        in_place = placement.params_on_host and not placement.delayed and u.shard is not None
        u.host = HostShard(u, k, full[:k].to("cpu"), placement, home=u.shard[:k] if in_place else None)
        u.host_numel = k
        # A view of the old buffer would keep all of it alive: copy the device part out.
        u.master = nn.Parameter(full[k:] if aliased else full[k:].clone())
        if not aliased:
            u.ledger.hold(f"{u.name}/master", "master", u.master)
        u.master_grad = u.ledger.hold(f"{u.name}/master_grad", "grads",
                                      torch.zeros(b - a - k, dtype=torch.float32, device=u.device))
        shards.append(u.host)
    return shards
