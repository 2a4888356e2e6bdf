"""The byte rules: what a placement allocates per tier and ledger kind on this rank, before
anything is allocated.

One home for the rules the start-up checks, the estimator (zerokit.memory) and the placement
planner (engine/planner.py) all read ([Note: the estimator's byte rules] in memory/estimate.py):
- `plan_layouts`: every unit's buffer records (policy/layout.py `plan_layout`), the max_in_cpu
  budgets spent in unit order;
- `planned_host_need`: the host bytes (the records, the host parts' optimizer state, the held
  gradients' pool, the NVMe stream's buffer sets, the weight shards read ahead);
- `planned_bytes`: the model states per tier and kind (device and nvme records, the optimizer
  state of each part, the second file slot of a speculative step, and the host need above);
- `reduce_buffer_bytes`: the gradient buffers of the reductions in flight (one unit's at world
  1, where each completes as it is launched; the same under every placement);
- `gradient_file_io` / `gradient_write_bytes`: the host buffers of the gradient pieces on their
  way to and from NVMe files (the tier's write window and read-ahead, sized here).
Pure functions: nothing here allocates.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zerokit.engine import host_budget
from zerokit.io.buffers import ALIGN
from zerokit.parts.nvme import GRAD_CHUNK_BYTES
from zerokit.parts.nvme_executor import StreamSettings, buffer_set_bytes
from zerokit.policy import PartitionPolicy, PlacementPolicy
from zerokit.policy.layout import UnitLayout, plan_layout
from zerokit.tier_names import TierName
from zerokit.tiers.ledger import KINDS, TIERS
from zerokit.tiers.nvme import WRITES_IN_FLIGHT_BYTES

# Host bytes by ledger kind: engine/host_budget.py HostNeed's fields.
HOST_FIELDS = {"weights": "weights", "master": "master", "grads": "grads",
               "optimizer_state": "state", "buffers": "buffers", "restores": "restores"}


def plan_layouts(groups: list, world: int, rank: int, cuda: bool, policy: PartitionPolicy,
                 dtype: torch.dtype, reduce: torch.dtype, accumulation: int,
                 placement: PlacementPolicy) -> list[UnitLayout]:
    """Every unit's buffer records under `placement` (policy/layout.py; pure, allocates nothing):
    the engine's plan, the estimator's (zerokit.memory) and the planner's are this one function."""
    layouts, ram_left = [], placement.ram_numel  # the host budget, spent in unit order
    param_ram_left = placement.param_ram_numel  # offload_param.max_in_cpu, the same way
    grad_ram_left = placement.grad_ram_numel or 0  # nvme_gradients_max_in_cpu, the same way
    for _name, _module, _group, trainable, params in groups:
        layouts.append(plan_layout(sum(p.numel() for _, p in params), world, rank,
                                   policy, placement, dtype, reduce, trainable=trainable,
                                   grad_accum_steps=accumulation, cuda=cuda,
                                   ram_left=ram_left, param_ram_left=param_ram_left,
                                   grad_ram_left=grad_ram_left))
        ram_left -= layouts[-1].host_numel if placement.nvme else 0
        grad_ram_left -= layouts[-1].held_nvme_numel
        if placement.params_on_nvme and layouts[-1].record("shard").tier is TierName.HOST:
            param_ram_left -= layouts[-1].shard_numel
    return layouts


def stream_settings(cfg, placement: PlacementPolicy, layouts: list[UnitLayout]) -> StreamSettings:
    off = cfg.zero_optimization.offload_optimizer
    return StreamSettings(cfg.zero_optimization.sub_group_size, off.buffer_count,
                          off.pipeline_read, off.pipeline_write,
                          gradients_in_files=any(lay.has("nvme_grad0") for lay in layouts),
                          weights_in_files=placement.params_on_nvme)


def planned_host_need(cfg, placement: PlacementPolicy, layouts: list[UnitLayout],
                      kind: str | None) -> host_budget.HostNeed:
    """Host bytes this rank allocates under `placement`: the layouts' host records and the host
    parts' optimizer state (host_budget.host_need), the held gradients' pool, the NVMe stream's
    buffer sets and the weight shards read ahead from NVMe. Pure: the start-up check, the
    estimator (zerokit.memory) and the planner read the same figure."""
    need = host_budget.host_need(layouts, kind, placement.state_dtype)
    if placement.step_in_backward:  # gradients held until the step decides, and the restores
        held, need.restores, _ = host_budget.speculation_need(layouts, kind, placement.master_dtype,
                                                              placement.state_dtype,
                                                              placement.gradient_dtype)
        need.grads += held
    else:  # the nvme parts' gradients held without a file (host parts': records)
        need.grads += placement.gradient_dtype.itemsize * sum(lay.held_nvme_numel for lay in layouts)
    largest = max((lay.nvme_numel for lay in layouts), default=0) if placement.nvme else 0
    if largest:
        need.buffers += buffer_set_bytes(stream_settings(cfg, placement, layouts), kind, largest,
                                         placement.master_dtype, placement.state_dtype,
                                         placement.gradient_dtype)
    need.buffers += gradient_write_bytes(layouts)
    shards = [lay.record("shard") for lay in layouts if lay.has("shard_buffer")]
    if shards:  # the shards read ahead (buffer_count) and the one a gather reads now: at most
        # the largest buffer_count + 1 of them (a larger shard than buffer_size is not read ahead)
        element = torch.empty(0, dtype=shards[0].dtype).element_size()
        sizes = sorted((min(r.numel, placement.param_buffer_size) for r in shards), reverse=True)
        need.buffers += sum(sizes[:placement.param_buffer_count + 1]) * element
    return need


@dataclass(frozen=True)
class GradientFileIO:
    """The host bytes the gradient pieces bound for NVMe files keep in flight (parts/nvme.py
    FileGradient, [Note: gradients on NVMe]): `write_window`, the tier's WriteWindow, and
    `read_ahead`, the tier's ReadAhead ([Note: gradient read-ahead] in tiers/read_ahead.py)."""

    write_window: int = WRITES_IN_FLIGHT_BYTES
    read_ahead: int = 0

    def apply(self, nvme) -> None:
        nvme.write_window.limit = self.write_window
        nvme.read_ahead.limit = self.read_ahead


def gradient_file_io(layouts: list[UnitLayout]) -> GradientFileIO | None:
    """The write window holds the largest part's gradient file (chunks of GRAD_CHUNK_BYTES),
    at least WRITES_IN_FLIGHT_BYTES: a unit's pieces then write while backward computes the next
    units (with a window of 64 MiB, each 160-260 MB unit of a 1B model waited for most of its
    own writes). With accumulation the earlier micro-steps' sums are read as much ahead. None
    where no part has a gradient file (no nvme part, or the gradients held in memory)."""
    files = [lay.record("nvme_grad0") for lay in layouts if lay.has("nvme_grad0")]
    if not files:
        return None
    element = torch.empty(0, dtype=files[0].dtype).element_size()
    largest = -(-max(r.numel for r in files) * element // GRAD_CHUNK_BYTES) * GRAD_CHUNK_BYTES
    accumulating = max(lay.reductions_per_step for lay in layouts) > 1
    return GradientFileIO(max(WRITES_IN_FLIGHT_BYTES, largest), largest if accumulating else 0)


def gradient_write_bytes(layouts: list[UnitLayout]) -> int:
    """The host buffers of the gradient pieces on their way to and from NVMe files: the write
    window and the chunk being filled, or all of a step's gradient bytes where they are fewer
    (each piece at least one buffer, rounded up to ALIGN), and the read-ahead; none where no
    part has a gradient file."""
    io = gradient_file_io(layouts)
    if io is None:
        return 0
    files = [lay.record("nvme_grad0") for lay in layouts if lay.has("nvme_grad0")]
    element = torch.empty(0, dtype=files[0].dtype).element_size()
    every = sum(-(-r.numel * element // ALIGN) * ALIGN for r in files)
    return min(io.write_window + GRAD_CHUNK_BYTES, every) + min(io.read_ahead, every)


def planned_bytes(cfg, placement: PlacementPolicy, layouts: list[UnitLayout],
                  kind: str | None) -> dict[TierName, dict[str, int]]:
    """The model states' bytes on this rank per tier and ledger kind under `placement`: the
    layouts' persistent device and nvme records, the optimizer state of the device and nvme
    parts (STATE_BYTES_PER_ELEMENT per element, halved with bf16.bf16_optimizer_states; an unknown
    optimizer counted as Adam), the nvme
    parts' second file slot when stepping in backward, and `planned_host_need` on the host.
    Transients (stage 3's gathered weights, the reductions' buffers, activations) are not in it."""
    out = {t: dict.fromkeys(KINDS, 0) for t in TIERS}
    state = host_budget.state_bytes_per_element(kind, placement.state_dtype)
    device, host, nvme = (out[t] for t in (TierName.DEVICE, TierName.HOST, TierName.NVME))
    for lay in layouts:
        for k, n in lay.bytes(TierName.DEVICE, transient=False).items():
            device[k] += n
        for k, n in lay.bytes(TierName.NVME).items():
            nvme[k] += n
        device["optimizer_state"] += state * sum(p.numel for p in lay.parts if p.tier is TierName.DEVICE)
        nvme["optimizer_state"] += state * lay.nvme_numel
    if placement.step_in_backward:  # the nvme parts' second file slot (parts/speculation.py)
        nvme["restores"] += host_budget.speculation_need(layouts, kind, placement.master_dtype,
                                                         placement.state_dtype)[2]
    need = planned_host_need(cfg, placement, layouts, kind)
    for k, name in HOST_FIELDS.items():
        host[k] += getattr(need, name)
    return out


def max_pending_reduce_numel(zero_cfg) -> int:
    """Elements of gradient reductions the engine lets be in flight before it waits for the
    oldest (Engine._drain): two buckets, enough to overlap and bounded in memory; none with
    overlap_comm false (DeepSpeed's meaning: wait for each reduction as soon as it starts)."""
    return 2 * zero_cfg.reduce_bucket_size if zero_cfg.overlap_comm else 0


def reduce_buffer_bytes(layouts: list[UnitLayout], policy: PartitionPolicy, compute: torch.dtype,
                        reduce: torch.dtype, zero_cfg, world: int) -> int:
    """The gradient buffers units/reduction.py `launch_reduce` allocates for its collective: stage
    2-3 copy every micro-step's gradients into one; below stage 2 the gradient (or its fp32
    sum) is reduced in place unless its dtype is not the reduce dtype. Each unit launches its
    reduction as its gradients complete; the engine waits for the oldest while more than
    `max_pending_reduce_numel` elements are in flight, so at most that many plus the newest
    unit's are alive at once (all of them, where they add up to less). At world 1 a reduction
    is complete when launched and the engine takes it at once: one unit's buffer. Each at the
    bytes a scratch buffer of its size holds (tiers/scratch.py: rounded up to ALIGN)."""
    element = torch.empty(0, dtype=reduce).element_size()
    sizes = []
    for lay in layouts:
        if not lay.parts:  # frozen: no gradient
            continue
        local = torch.float32 if lay.has("grad_acc") else compute
        if policy.shard_gradients or local != reduce:
            sizes.append(-(-lay.padded_numel * element // ALIGN) * ALIGN)
    if not sizes:
        return 0
    if world == 1:
        return max(sizes)
    return min(sum(sizes), max_pending_reduce_numel(zero_cfg) * element + max(sizes))
