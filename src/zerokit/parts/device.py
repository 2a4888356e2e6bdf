"""The device part of a unit's optimizer range: stepped by torch's optimizer on the compute
device. See [Note: optimizer parts] in parts/__init__.py."""
from __future__ import annotations

import torch
import torch.nn as nn

from zerokit.optim import host as host_kernels
from zerokit.policy.layout import OptimizerPart
from zerokit.tier_names import TierName


class DevicePart:
    """The device part: master and gradient on the compute device, stepped by torch's optimizer.

    `master` is the nn.Parameter torch's optimizer holds; where the layout makes it a view of the
    weights (fp32 compute), `in_place` is True and nothing is copied after the step. A bf16 master
    (bf16.bf16_master_weights_and_grads) is stepped by the host kernel's math on the device
    (parts/executors.py DeviceExecutor), its state in `state_dtype`, rounded with `rounding`
    (both set by engine/bf16_state.py `configure_parts`, as for host parts).
    """

    tier = TierName.DEVICE

    def __init__(self, span: OptimizerPart, master: nn.Parameter, grad: torch.Tensor,
                 home: torch.Tensor, in_place: bool, shard_gradients: bool):
        self.lo, self.hi = span.lo, span.hi
        self.master = master
        self.grad = grad
        self._home = home  # the weights' elements this part's master updates
        self.in_place = in_place
        self._adds = shard_gradients  # see [Note: one reduction, one meaning] in units/reduction.py
        self.state_dtype = torch.float32
        self.rounding: dict = {}

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    def take_grad(self, reduced: torch.Tensor, offset: int) -> None:
        """A reduced gradient piece for elements [lo + offset, ...) of this part."""
        dest = self.grad[offset:offset + reduced.numel()]
        if self._adds:
            host_kernels.accumulate(dest, reduced)
        else:
            dest.copy_(reduced)

    def grad_sq_norm(self) -> torch.Tensor:
        # Accumulated in float64 without materialising a float64 copy of the gradient. On a CPU
        # "device" the host kernel's SIMD sum (the one host parts use) does that 13-20x faster
        # than torch's float64 vector_norm (issue #29: 2.8 ms per 1.5M-element unit, 10-14 ms a
        # step of bench_step); its torch fallback gives the same numbers where it is not built.
        if self.grad.device.type == "cpu":
            return torch.tensor(host_kernels.grad_sq_norm(self.grad)[0], dtype=torch.float64)
        return torch.linalg.vector_norm(self.grad, dtype=torch.float64).square()

    def zero_grad(self) -> None:
        self.grad.zero_()

    def write_weights(self) -> None:
        if not self.in_place:
            self._home.copy_(self.master.detach())

    def absorb(self, new: torch.Tensor) -> None:
        """Compute weights were edited: carry changed elements into the master. Elements whose
        16-bit rounding did not change keep their fp32 value."""
        if self.in_place:
            return  # fp32: the master is these weights
        with torch.no_grad():
            changed = new != self.master.to(new.dtype)
            self.master[changed] = new[changed].to(self.master.dtype)

    def master_values(self) -> torch.Tensor:
        return self.master.detach()

    def wait(self) -> None:
        """The device step ends with the step: nothing runs on."""
