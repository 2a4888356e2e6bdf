"""What the host kernel's executors ask of a part, and the pieces host and nvme parts share.

A host part (parts/host.py) and an nvme part (parts/nvme.py) are both stepped by the native
kernel on an executor's worker (parts/executors.py), but they hold their state differently: the
host part in host tensors, the nvme part in file ranges streamed a sub-group at a time. Neither is
the other: each implements `KernelPart`, the small interface the executors use, and both are a
`PartSpan`: elements [lo, hi) of the unit's optimizer range and a `WeightsOut` (the route of
their new weights to the unit's compute weights). The kernel itself
sees neither part: a step function reads `KernelOperands`, which the host executor takes from a
host part whole and the streaming executor builds per sub-group from its buffer sets.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch

# States per optimizer family, by the names torch uses (so a checkpoint can share them).
STATE_NAMES = {"adam": ("exp_avg", "exp_avg_sq"), "adagrad": ("sum",), "lion": ("exp_avg",)}


@dataclass
class KernelOperands:
    """One call of the host kernel (parts/executors.py `kernel_for`): contiguous host tensors of
    one length, updated in place (master, state) or written (out16: the new 16-bit weights)."""

    master: torch.Tensor
    grad: torch.Tensor
    state: dict[str, torch.Tensor]
    out16: torch.Tensor | None
    step: int  # the 1-based bias-correction count of this update
    # bf16 stores' rounding (zerokit/optim/host.py: stochastic_rounding, seed, index_base); empty:
    # round to nearest
    rounding: dict = field(default_factory=dict)


class WeightsOut:
    """A kernel part's new weights on their way to the weights' home (the unit's shard or its
    range of the flat weights): the 16-bit output the kernel wrote, or the fp32 master itself
    where there is none; nothing to copy where the kernel writes the home in place (offload_param
    without the delayed update: `out16`, or the master, is a view of the host shard)."""

    def __init__(self, home, out16: torch.Tensor | None, in_place: bool, pinned: bool):
        self.home = home  # a tensor, or (weights on NVMe) tiers/nvme_shard.py FileHome
        self.out16 = out16
        self.in_place = in_place
        self.pinned = pinned  # host buffers cross to a CUDA device: the copy may be asynchronous

    def write(self, master: torch.Tensor | None) -> None:
        """The new weights -> the home (`master` read only where there is no 16-bit output)."""
        if not self.in_place:
            self.home.copy_(self.out16 if self.out16 is not None else master,
                            non_blocking=self.pinned)

    def absorb(self, changed: torch.Tensor, new: torch.Tensor) -> None:
        """An edit of the compute weights reaches the 16-bit output too, so that a delayed
        update's write-back does not undo it."""
        if self.out16 is not None:
            self.out16[changed] = new[changed].to(self.out16.dtype)


class PartSpan:
    """What a host part and an nvme part both are: elements [lo, hi) of a unit's optimizer range
    whose new weights leave through a `WeightsOut`. A base of both, holding only that."""

    def __init__(self, unit, lo: int, hi: int, out: WeightsOut):
        self._unit = weakref.ref(unit)  # the unit holds us: a strong link back would be a cycle
        self.lo, self.hi = lo, hi
        self.out = out

    @property
    def unit(self):
        return self._unit()

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def out16(self) -> torch.Tensor | None:
        """The 16-bit output in host memory: None in fp32 training (the master is the output)
        and where the weights' home is a file the stream writes directly."""
        return self.out.out16

    @property
    def pin(self) -> bool:
        return self.out.pinned


class KernelPart(Protocol):
    """What HostExecutor / NvmeExecutor and the engine's checkpoint code use of a part they step.

    lo, hi, numel   the part's elements of the unit's flat index space
    unit, tier      its unit; TierName.HOST or TierName.NVME (the executor that steps it)
    master, state   master and optimizer state, fp32 or bf16 (tensors, or file ranges on the
                    nvme tier)
    out16, pin      the kernel's 16-bit output (None where there is none) and whether it crosses
                    to a CUDA device asynchronously
    held            the parts/held_gradient.py HeldGradient where the gradient waits in host
                    memory (step_in_backward; an nvme part also with nvme_gradients 'host'),
                    else None
    steps, group    updates applied; the optimizer param group whose hyper-parameters apply
    busy            the worker that may write master / state (executors.WorkerDone), or None
    """

    lo: int
    hi: int
    steps: int
    group: int
    busy: object

    @property
    def numel(self) -> int: ...

    def begin_step(self, worker_done) -> None:
        """The executor's worker steps this part next: count it, take the gradient to read."""

    def init_state(self, family: str, fill: float = 0.0) -> None: ...

    def settle(self) -> None: ...

    def swap_grads(self) -> None: ...

    def wait(self) -> None: ...

    def write_weights(self) -> None: ...

    def master_values(self) -> torch.Tensor: ...
