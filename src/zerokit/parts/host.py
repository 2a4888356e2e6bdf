"""The host part of a unit's optimizer range: master, state, gradient and output buffers on the
host tier, stepped by the native kernel. See [Note: optimizer parts] in parts/__init__.py."""
from __future__ import annotations

import torch

from zerokit.policy.layout import OptimizerPart
from zerokit.parts.held_gradient import HeldGradient
from zerokit.parts.kernel_part import STATE_NAMES, KernelOperands, PartSpan, WeightsOut
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
        records = [buffers[n] for n in ("host_grad0", "host_grad1") if n in buffers]
        grad_dtype = unit.layout.offload_grad_dtype
        # a 16-bit gradient under a wider master, exact for one backward per step only: a second
        # backward's add is refused (refuse_sum)
        refused = unit.name if grad_dtype != self.master.dtype else None
        # step_in_backward: no gradient record between steps, one held while in use
        self.held = None if records else HeldGradient(self.numel, grad_dtype, refused)
        # where backward's pieces land (two records with the delayed update: one being stepped),
        # each first piece copied, not added ([Note: held gradients])
        self.gradients = [HeldGradient(self.numel, g.dtype, refused, buffer=g) for g in records] \
            if records else [self.held]
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
    def gradient(self) -> HeldGradient:
        """The gradient the current backward lands in and the next step reads."""
        return self.gradients[self.current]

    @property
    def grad(self) -> torch.Tensor:
        """The current gradient's buffer, every element written (settled)."""
        return self.gradient.values()

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
        """Land a reduced gradient bucket (this rank's, averaged) at `offset` of the host
        gradient: copied where nothing landed since the step, else added (accumulation)."""
        lo = offset
        if part.device.type == "cpu":
            self.gradient.add(part, lo)
            return
        hi = lo + part.numel()
        if any(a < hi and lo < b for _, a, b in self._staged):
            self._land_staged()  # an earlier micro-step's bucket still occupies this staging range
        self._staged.append((self.host_tier.copy(self.staging[lo:hi], part), lo, hi))

    def _land_staged(self) -> None:
        """Finish the device -> host gradient copies in flight (CUDA) and land them."""
        for done, lo, hi in self._staged:
            done.synchronize()
            self.gradient.add(self.staging[lo:hi], lo)
        self._staged = []

    def settle(self) -> None:
        """Every piece landed; elements none reached are zero."""
        self._land_staged()
        self.gradient.settle()

    def grad_sq_norm(self) -> torch.Tensor:
        self._land_staged()
        return torch.tensor(self.gradient.sq_norm(), dtype=torch.float64,  # taken as pieces landed
                            device=self.unit.device)

    def zero_grad(self) -> None:
        """The step is done: the next piece starts a new gradient (nothing is zeroed now)."""
        self._land_staged()
        self.gradient.clear()

    def swap_grads(self) -> None:
        """Delayed update: the step just launched reads this buffer; backward fills the other
        (cleared by the engine's zero_grad at the end of the same step)."""
        self.current = (self.current + 1) % len(self.gradients)

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
