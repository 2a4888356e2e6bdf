"""The host part of a unit's optimizer range: master, state, gradient and output buffers on the
host tier, stepped by the native kernel. See [Note: optimizer parts] in parts/__init__.py."""
from __future__ import annotations

import torch

from zerokit.policy.layout import OptimizerPart
from zerokit.parts.held_gradient import HeldGradient, refuse_sum
from zerokit.parts.kernel_part import STATE_NAMES, KernelOperands, PartSpan, WeightsOut
from zerokit.optim import host as host_kernels
from zerokit.tier_names import TierName
from zerokit.tiers.tier import CopyHandle, Tier


class HostPart(PartSpan):
    """The host part: master, optimizer state, gradient and output buffers on the host tier,
    stepped by the native kernel (parts/executors.py `HostExecutor`); a `KernelPart`
    (parts/kernel_part.py)."""

    tier = TierName.HOST

    def __init__(self, unit, span: OptimizerPart, buffers: dict[str, torch.Tensor], host: Tier,
                 home: torch.Tensor, in_place: bool, pinned: bool):
        # the new weights' way to the compute weights (in_place: the kernel writes them itself)
        super().__init__(unit, span.lo, span.hi,
                         WeightsOut(home, buffers.get("host_out16"), in_place, pinned))
        self.master = buffers["host_master"]
        self.grads = [buffers[n] for n in ("host_grad0", "host_grad1") if n in buffers]
        # step_in_backward: no gradient buffer between steps, one held while in use
        grad_dtype = unit.layout.offload_grad_dtype
        # a 16-bit gradient under a wider master, exact for one backward per step only: the
        # elements each backward added since the step (a second add is refused: refuse_sum)
        refused = unit.name if grad_dtype != self.master.dtype else None
        self.held = None if self.grads else HeldGradient(self.numel, grad_dtype, refused)
        self._landed: list[tuple[int, int]] | None = [] if refused and self.grads else None
        self.current = 0
        self.staging = buffers.get("host_staging")
        self.host_tier = host
        self.state: dict[str, torch.Tensor] = {}
        self.steps = 0  # host updates applied, the 1-based bias-correction count of the next one
        self.group = 0  # the optimizer param group whose hyper-parameters apply (bound later)
        self._staged: list[tuple[CopyHandle, int, int]] = []  # copies in flight
        self.grad_in_flight: torch.Tensor | None = None  # the buffer the running update reads
        self.busy = None  # the executor worker that may write master/state (executors.WorkerDone)
        # bf16.bf16_optimizer_states: the state's dtype; bf16.stochastic_rounding: the host
        # kernel's rounding arguments (set by the engine, engine/bf16_state.py `configure_parts`)
        self.state_dtype = torch.float32
        self.rounding: dict = {}
        self.restore = None  # step_in_backward: what a rollback restores (parts/speculation.py)

    def begin_step(self, worker_done) -> None:
        """The executor's worker steps this part next: counted, the gradient it reads taken
        (the delayed update's backward fills the other buffer meanwhile), marked busy."""
        self.steps += 1
        self.grad_in_flight = self.grad
        self.busy = worker_done

    def operands(self) -> KernelOperands:
        """The kernel's arguments: the whole part (the worker's, after begin_step)."""
        return KernelOperands(self.master, self.grad_in_flight, self.state, self.out16, self.steps,
                              self.rounding)

    @property
    def grad(self) -> torch.Tensor:
        """The buffer the current backward accumulates into and the next step reads."""
        return self.held.values() if self.held is not None else self.grads[self.current]

    def init_state(self, family: str, fill: float = 0.0) -> None:
        if self.state:
            return
        for key in STATE_NAMES[family]:
            self.state[key] = self.host_tier.allocate(f"{self.unit.name}/host_state.{key}",
                                                     "optimizer_state", self.numel, self.state_dtype)
            if fill:
                self.state[key].fill_(fill)

    # ---- gradients in ------------------------------------------------------------------------
    def take_grad(self, part: torch.Tensor, offset: int) -> None:
        """Add a reduced gradient bucket (this rank's, averaged) at `offset` of the host gradient.
        Adds: the host gradient is zeroed after every step (below stage 2 reduced once: written)."""
        lo, hi = offset, offset + part.numel()
        if self._landed is not None:
            if any(a < hi and lo < b for a, b in self._landed):
                refuse_sum(self.unit.name, self.grad.dtype)
            self._landed.append((lo, hi))
        if part.device.type == "cpu":
            if self.held is not None:
                self.held.add(part, lo)
            else:
                self.grad[lo:hi].add_(part)
            return
        if any(a < hi and lo < b for _, a, b in self._staged):
            self.settle()  # an earlier micro-step's bucket still occupies this staging range
        self._staged.append((self.host_tier.copy(self.staging[lo:hi], part), lo, hi))

    def settle(self) -> None:
        """Finish the device -> host gradient copies in flight (CUDA) and accumulate them."""
        for done, lo, hi in self._staged:
            done.synchronize()
            if self.held is not None:
                self.held.add(self.staging[lo:hi], lo)
            else:
                self.grad[lo:hi].add_(self.staging[lo:hi])
        self._staged = []
        if self.held is not None:
            self.held.settle()

    def grad_sq_norm(self) -> torch.Tensor:
        self.settle()
        total = (self.held.sq_norm() if self.held is not None else  # taken as pieces landed
                 host_kernels.grad_sq_norm(self.grad)[0])
        return torch.tensor(total, dtype=torch.float64, device=self.unit.device)

    def zero_grad(self) -> None:
        self.settle()
        if self.held is not None:
            self.held.clear()
        else:
            self.grad.zero_()
        if self._landed is not None:
            self._landed = []

    def swap_grads(self) -> None:
        """Delayed update: the step just launched reads this buffer; backward fills the other
        (zeroed by the engine's zero_grad at the end of the same step: not twice)."""
        self.current = (self.current + 1) % len(self.grads)
        if self._landed is not None:
            self._landed = []

    # ---- weights out -------------------------------------------------------------------------
    def wait(self) -> None:
        if self.busy is not None:
            self.busy.wait()

    def master_values(self) -> torch.Tensor:
        """The master as of the last step (an update applied in backward counts from the step
        that commits it, as an nvme part's live slot does)."""
        self.wait()
        if self.restore is not None and self.restore.saved:
            return self.restore.master
        return self.master

    def write_weights(self) -> None:
        """The host part's new weights -> the unit's compute weights (its shard or flat range)."""
        self.out.write(self.master)

    def absorb(self, new: torch.Tensor) -> None:
        """Compute weights were edited: carry changed elements into the host master."""
        self.wait()
        new = new.to("cpu")
        changed = new != self.master.to(new.dtype)
        self.master[changed] = new[changed].to(self.master.dtype)
        self.out.absorb(changed, new)
