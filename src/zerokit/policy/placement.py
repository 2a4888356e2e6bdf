"""Where each piece of a rank's optimizer shard lives: the placement policy (offload, Twin-Flow).

The partition policy decides *what* a rank owns (its optimizer range per unit); placement decides
*where* that range's fp32 master, optimizer state and gradient live and where it is stepped.
ZeRO-Offload is ratio 1 (all on the host), no offload is ratio 0, Twin-Flow anything between: the
first `host_numel(L)` elements of a unit's optimizer range (as DeepSpeed: the first r of the
weights on the CPU) are stepped by the host kernel, the rest by torch's optimizer on the device,
at the same time. A stage never appears here: every stage >= 1 has an optimizer shard to place.

`params_on_host` (offload_param) places the other piece a rank owns at stage 3, its compute-dtype
weight shard: it lives on the host tier and crosses to the device when the unit is gathered.
`params_on_nvme` (offload_param device 'nvme') puts it in a file instead, read through a host
buffer when gathered, except the first shards up to `param_ram_numel` elements (max_in_cpu), which
stay on the host tier (`param_tier`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zerokit.tier_names import TierName

# Split points are multiples of this many elements, so the host part starts and ends on a
# 64-element (256-byte fp32) boundary, the unit the host kernels split work between threads in.
SPLIT_ALIGN = 64
# A disk sector (4096 bytes) of the smallest element (2 bytes): io/buffers.py SECTOR_ELEMENTS,
# restated here because policy sits beside io in the layering (tests/unit/test_layout.py checks).
SECTOR_ELEMENTS = 2048


@dataclass(frozen=True)
class PlacementPolicy:
    """
    ratio: fraction of each unit's optimizer range whose master, state and gradient live on the
        host tier and are stepped there (0: all on the device).
    pin_memory: host buffers that cross to the device are page-locked (only where CUDA exists).
    delayed: the host step of step t overlaps step t+1's forward and backward (changes the math).
    warmup_steps: normal steps before the delay starts.
    auto: ratio "auto": `ratio` is a placeholder until engine/auto_ratio.py measures and decides.
    params_on_host: offload_param: each unit's persistent weight shard lives on the host tier.
    param_pin_memory: the host weight shards are page-locked (only where CUDA exists).
    nvme: offload_optimizer device 'nvme' (ZeRO-Infinity): the offloaded elements' master,
        gradient and optimizer state live in files on the nvme tier, streamed through the host
        kernel.
    ram_numel: with nvme, offload_optimizer.max_in_cpu: offloaded elements per rank (first units
        first) that stay in host memory instead; the host budget.
    params_on_nvme: offload_param device 'nvme': weight shards are files on the nvme tier.
    param_ram_numel: with params_on_nvme, offload_param.max_in_cpu: weight shard elements per rank
        (whole shards, first units first) that stay on the host tier instead.
    param_buffer_count / param_buffer_size: with params_on_nvme, offload_param.buffer_count and
        buffer_size: shards read ahead of their gather, at most this many, each at most this many
        elements (larger shards are read when gathered).
    step_in_backward: offload_optimizer.step_in_backward ("auto" resolved: on for an offloaded
        optimizer without the delayed update): the host and NVMe parts of a unit are stepped
        speculatively as soon as backward has reduced its gradient (parts/speculation.py); their
        gradients are held in host memory until the step decides, never written to a file.
        initialize turns it off where the host cannot hold that (engine/assemble.py).
    nvme_grads_held: with nvme, offload_optimizer.nvme_gradients 'host': the nvme parts'
        gradients are held in host memory (parts/held_gradient.py), stepped in step(), never
        written to a file (`holds_nvme_gradients`: this, or step_in_backward).
    grad_ram_numel: with nvme_grads_held, offload_optimizer.nvme_gradients_max_in_cpu: gradient
        elements per rank held (whole nvme parts, first units first; `holds_gradient`), the other
        parts' gradients in files; None: every part's.
    master_dtype / state_dtype: the master weights (and the gradients the optimizer reads) and
        the optimizer state, fp32 or bf16 (bf16.bf16_master_weights_and_grads /
        bf16_optimizer_states; engine/bf16_state.py decides and checks what is wired).
    stochastic_rounding / rounding_seed: bf16 stores of the host kernel round stochastically,
        from this seed (zerokit/optim/rounding.py).
    grad_dtype: the dtype the offloaded parts' gradients wait for the step in (host gradient
        buffers, held gradients, NVMe gradient files) where it is not the master's: the
        reduced gradient's own 16-bit dtype, where that holds every value exactly
        (engine/precision.py `with_gradient_dtype`, offload_optimizer.gradient_dtype); None: the
        master's (`gradient_dtype`).
    """

    ratio: float = 0.0
    pin_memory: bool = False
    delayed: bool = False
    warmup_steps: int = 0
    auto: bool = False
    auto_reason: str = ""  # what "auto" measured and picked, for the plan
    params_on_host: bool = False
    param_pin_memory: bool = False
    nvme: bool = False
    ram_numel: int = 0
    params_on_nvme: bool = False
    param_ram_numel: int = 0
    param_buffer_count: int = 5
    param_buffer_size: int = 100_000_000
    step_in_backward: bool = False
    nvme_grads_held: bool = False
    grad_ram_numel: int | None = None
    master_dtype: torch.dtype = torch.float32
    state_dtype: torch.dtype = torch.float32
    stochastic_rounding: bool = False
    rounding_seed: int = 0
    grad_dtype: torch.dtype | None = None

    @classmethod
    def from_config(cls, zero_cfg) -> "PlacementPolicy":
        off, par = zero_cfg.offload_optimizer, zero_cfg.offload_param
        for key, section in (("offload_optimizer", off), ("offload_param", par)):
            if section.device == "auto":
                raise ValueError(f"zero_optimization.{key}.device 'auto' is chosen by the placement "
                                 f"planner at initialize (engine/planner.py, from the memory "
                                 f"budgets); give 'none', 'cpu' or 'nvme' here")
        params = {"params_on_host": par.device == "cpu", "param_pin_memory": par.pin_memory,
                  "params_on_nvme": par.device == "nvme", "param_ram_numel": par.max_in_cpu,
                  "param_buffer_count": par.buffer_count, "param_buffer_size": par.buffer_size}
        if off.device == "nvme":
            if off.ratio == "auto":
                raise ValueError("offload_optimizer.ratio 'auto' with device 'nvme' is not "
                                 "implemented; give a number in [0, 1]")
            return cls(float(off.ratio), off.pin_memory, off.delayed_update.enabled,
                       off.delayed_update.warmup_steps, nvme=True, ram_numel=off.max_in_cpu,
                       step_in_backward=_steps_in_backward(off),
                       nvme_grads_held=off.nvme_gradients == "host",
                       grad_ram_numel=off.nvme_gradients_max_in_cpu, **params)
        if off.device != "cpu":
            return cls(**params)
        auto = off.ratio == "auto"
        return cls(1.0 if auto else float(off.ratio), off.pin_memory, off.delayed_update.enabled,
                   off.delayed_update.warmup_steps, auto, step_in_backward=_steps_in_backward(off),
                   **params)

    @property
    def offloads(self) -> bool:
        return self.ratio > 0.0

    @property
    def gradient_dtype(self) -> torch.dtype:
        """What the offloaded parts keep their gradients in (the kernel widens it as it reads)."""
        return self.grad_dtype or self.master_dtype

    @property
    def holds_nvme_gradients(self) -> bool:
        """Every nvme part's gradient waits for the step in host memory, none in a file."""
        return self.nvme and (self.step_in_backward
                              or (self.nvme_grads_held and self.grad_ram_numel is None))

    def holds_gradient(self, part_numel: int, grad_ram_left: int) -> bool:
        """Whether an nvme part of `part_numel` elements holds its gradient in host memory when
        `grad_ram_left` elements of nvme_gradients_max_in_cpu remain (the units before it spent
        the rest: engine/byte_plan.py `plan_layouts`)."""
        return self.holds_nvme_gradients or (self.nvme and self.nvme_grads_held
                                             and part_numel <= grad_ram_left)

    def host_numel(self, length: int) -> int:
        """Elements [0, host_numel) of an optimizer range of `length` live and step on the host."""
        if self.ratio >= 1.0:
            return length
        k = round(self.ratio * length / SPLIT_ALIGN) * SPLIT_ALIGN
        return max(0, min(length, k))

    def ram_split(self, offloaded: int, ram_left: int) -> int:
        """With nvme: of a unit's `offloaded` elements, how many stay in host memory when
        `ram_left` elements of the budget remain (aligned unless all of them fit).

        64-aligned for the host kernels; where gradients go to files, on a sector
        (SECTOR_ELEMENTS): the unit's NVMe part then starts on one, so its gradient pieces,
        cut by the reduction's buckets, land on sectors of its file ([Note: buckets on sectors]
        in units/reduction.py); split elsewhere, that part's pieces go through bounce buffers.
        At 1B with gradients in files the planner's max_in_cpu 3,746,432 (64-aligned) ran
        20.5 s a step against 16.0 with max_in_cpu 0 in one invocation; split on a sector
        (2,494,400) it ran 14.5 s against 15.3 (bench_infinity-1b-budget-grid-20261207.json)."""
        if not self.nvme:
            return offloaded
        if ram_left >= offloaded:
            return offloaded
        align = SPLIT_ALIGN if self.holds_nvme_gradients else SECTOR_ELEMENTS
        return max(0, ram_left // align * align)

    def param_tier(self, shard_numel: int, param_ram_left: int) -> TierName:
        """The tier of a stage-3 weight shard of `shard_numel` elements when `param_ram_left`
        elements of offload_param.max_in_cpu remain."""
        if self.params_on_nvme:
            return TierName.HOST if shard_numel <= param_ram_left else TierName.NVME
        return TierName.HOST if self.params_on_host else TierName.DEVICE

    def describe_params(self) -> str:
        if self.params_on_nvme:
            return (f"offload_param: weight shards on NVMe (ZeRO-Infinity), read ahead into up to "
                    f"{self.param_buffer_count} host buffers (offload_param.buffer_count) before "
                    f"their gather and written back after each step; up to "
                    f"{self.param_ram_numel:,} elements per rank kept in host memory "
                    f"(offload_param.max_in_cpu)")
        return ("offload_param: weight shards on the host, copied host -> device when gathered "
                "(prefetched ahead of use)" if self.params_on_host else
                "offload_param: none (weight shards on the device)")

    def describe(self) -> str:
        if not self.offloads:
            return "offload: none (master, optimizer state and gradients on the device)"
        what = ("ZeRO-Offload: master + optimizer state + gradient shards on the host"
                if self.ratio >= 1.0 else
                f"Twin-Flow: {self.ratio:.3g} of each optimizer shard on the host, "
                f"{1 - self.ratio:.3g} on the device, stepped at the same time")
        if self.nvme:
            share = "all" if self.ratio >= 1.0 else f"{self.ratio:.3g}"
            grads = "" if self.holds_nvme_gradients else "gradient + "
            what = (f"ZeRO-Infinity: master + {grads}optimizer state of {share} of each "
                    f"optimizer shard on NVMe, streamed in sub-groups "
                    f"through the host kernel; up to {self.ram_numel:,} elements per rank kept "
                    f"in host memory (offload_optimizer.max_in_cpu)")
            if self.nvme_grads_held and not self.step_in_backward:
                held = ("" if self.grad_ram_numel is None else
                        f" up to {self.grad_ram_numel:,} elements per rank "
                        f"(offload_optimizer.nvme_gradients_max_in_cpu, whole parts), the rest "
                        f"in files,")
                what += (f"; the NVMe parts' gradients held in host memory{held} until the step "
                         f"(offload_optimizer.nvme_gradients 'host')")
        if self.grad_dtype is not None:
            name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[self.grad_dtype]
            what += (f"; gradients kept in {name} until the "
                     f"step (exact at one micro-step per step: offload_optimizer.gradient_dtype)")
        if self.auto_reason:
            what += f" (auto: {self.auto_reason})"
        if self.delayed:
            stale = "gradients" if self.ratio >= 1.0 else "the host part's weights"
            what += (f"; delayed parameter update after {self.warmup_steps} steps "
                     f"({stale} one step stale)")
        if self.step_in_backward:
            what += ("; each unit's offloaded part stepped in backward, once its gradient is "
                     "reduced (offload_optimizer.step_in_backward)")
        return "offload: " + what


def _steps_in_backward(off) -> bool:
    """offload_optimizer.step_in_backward resolved: "auto" is on unless the delayed update is
    (an explicit true with it is refused by the config)."""
    if off.step_in_backward == "auto":  # a partial hold steps in step(): see the key
        return not off.delayed_update.enabled and off.nvme_gradients_max_in_cpu is None
    return bool(off.step_in_backward)
