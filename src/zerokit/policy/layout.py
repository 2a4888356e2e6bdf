"""Where every byte of a unit lives: one pure function from sizes and policies to buffer records.

[Note: unit layout records]
`plan_layout` turns (unit size, world, rank, partition policy, placement policy, dtypes) into a
`UnitLayout`: the unit's element geometry, its optimizer range split into ordered parts (host part
first, then the device part: Twin-Flow is two parts), and one `BufferRecord` per buffer the unit
holds. A record says what the buffer is (`name`, its ledger `kind`), where it lives (`tier`), its
dtype, which elements of the unit's flat index space [0, padded_numel) it covers, and, where it
owns no storage of its own, which record it is a view of (`alias_of`). The Unit allocates from the
records in order (units/unit.py `_allocate`); nobody compares storage pointers to find an alias.

Records (element ranges in the unit's flat index space; `a, b` = the optimizer range, `k` = the
host part's length, `r` = this rank's shard):
    weights      compute dtype, [0, P)   device; transient at stage 3 (storage only while gathered),
                                         except where it is the shard (weights_are_shard)
    shard        compute dtype, shard r  stage 3: device, or host with offload_param cpu, or
                 nvme (a file range) with offload_param nvme beyond its max_in_cpu budget
    shard_buffer compute dtype, shard r  with the shard on nvme: the host buffer the shard passes
                 through, transient ([Note: weight shards on NVMe] in tiers/nvme_shard.py)
    grads        compute dtype, [0, P)   gradients reduced once per boundary (stage < 2)
    grad_acc     fp32, [0, P)            16-bit compute, accumulation > 1, stage < 2
    master       master, [a + k, b)      the device part's master (fp32 compute: the weights);
                                         `master` = placement.master_dtype (below)
    master_grad  master, [a + k, b)      the device part's reduced gradient (stage 0 fp32: grads)
    host_master  master, [a, a + k)      the host part's master (fp32 + in-place: the host shard);
                                         `master` = placement.master_dtype: fp32, or bf16 with
                                         bf16.bf16_master_weights_and_grads
    host_grad0/1 gradient, [a, a + k)    the host part's gradient (two with the delayed update,
                                         none with step_in_backward: held only while in use);
                                         `gradient` = placement.gradient_dtype: the master's,
                                         or the 16-bit gradient's own where that is exact
                                         ([Note: 16-bit offloaded gradients] in engine/precision.py)
    host_out16   compute dtype, [a, a+k) the host kernel's 16-bit output (in-place: the host shard)
    host_staging fp32, [a, a + k)        pinned landing buffer for device -> host gradients (CUDA)
    nvme_*       with offload_optimizer device 'nvme' the offloaded range [a, a + k) splits:
                 [a, a + h) is the host part above (h: the max_in_cpu budget), [a + h, a + k)
                 the nvme part: nvme_master and nvme_grad0 (and nvme_grad1 with the delayed
                 update; none where the gradients are held in host memory: step_in_backward or
                 offload_optimizer.nvme_gradients 'host') on the nvme tier, the master in its
                 dtype (fp32, or bf16 with bf16.bf16_master_weights_and_grads) and the gradient
                 in placement.gradient_dtype (as host_grad), nvme_out
                 compute dtype on the host (offload_param, no delay: the host shard; none
                 where the shard is on NVMe: the stream writes the new weights to its file)
The host part's optimizer state is allocated when the optimizer is known (HostPart.init_state),
in placement.state_dtype, through the same host tier, so the ledger counts it as allocated too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zerokit.policy import PartitionPolicy, PlacementPolicy
from zerokit.tier_names import TierName

ALIGN = 32  # elements per shard boundary: keeps every shard 64-byte aligned for SIMD kernels


@dataclass(frozen=True)
class BufferRecord:
    """One buffer of a unit: what it is, where it lives, which elements it covers."""

    name: str
    kind: str            # the ledger kind: weights, grads, master, optimizer_state, buffers
    tier: TierName
    dtype: torch.dtype
    lo: int              # element range [lo, hi) in the unit's flat index space
    hi: int
    alias_of: str | None = None  # a view of that record's storage over the same elements
    pinned: bool = False  # page-locked host memory (crosses to a CUDA device)
    transient: bool = False  # storage exists only while in use (stage 3's gathered weights)

    def __post_init__(self):  # a plain name ("host") becomes the enum: code compares with `is`
        object.__setattr__(self, "tier", TierName(self.tier))

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class OptimizerPart:
    """A contiguous piece of a unit's optimizer range stepped on one tier."""

    tier: TierName
    lo: int
    hi: int

    def __post_init__(self):
        object.__setattr__(self, "tier", TierName(self.tier))

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class UnitLayout:
    numel: int
    padded_numel: int
    shard_numel: int
    shard_range: tuple[int, int]          # this rank's shard [r * shard_numel, (r + 1) * shard_numel)
    opt_range: tuple[int, int]
    parts: tuple[OptimizerPart, ...]      # host part (if any) first, then the device part
    records: tuple[BufferRecord, ...]     # in allocation order: a record's alias comes before it
    reductions_per_step: int = 1          # micro-steps whose gradients leave the unit: each, when
                                          # shard_gradients (the files' read-add-write), else 1
    # what an offloaded part's gradient waits in, a held one too (placement.gradient_dtype)
    offload_grad_dtype: torch.dtype = torch.float32

    @property
    def gathers(self) -> bool:
        """Stage 3 gathers the weights into storage of their own (see [Note: one rank's shard is
        its weights] for when it does not)."""
        return self.record("weights").transient

    def has(self, name: str) -> bool:
        return any(r.name == name for r in self.records)

    def record(self, name: str) -> BufferRecord:
        for r in self.records:
            if r.name == name:
                return r
        raise KeyError(f"unit layout has no buffer {name!r}; it has {[r.name for r in self.records]}")

    def aliases(self, name: str, target: str) -> bool:
        """Is buffer `name` a view of `target`'s storage (directly or through another alias)?"""
        seen = name
        while self.has(seen):
            seen = self.record(seen).alias_of
            if seen is None:
                return False
            if seen == target:
                return True
        return False

    @property
    def host_numel(self) -> int:
        return sum(p.numel for p in self.parts if p.tier is TierName.HOST)

    @property
    def nvme_numel(self) -> int:
        return sum(p.numel for p in self.parts if p.tier is TierName.NVME)

    @property
    def held_nvme_numel(self) -> int:
        """Elements of the nvme part whose gradient is held in host memory (no gradient file)."""
        return 0 if self.has("nvme_grad0") else self.nvme_numel

    def bytes(self, tier: TierName, transient: bool = True) -> dict[str, int]:
        """Bytes the records own on `tier`, by ledger kind (aliases own nothing); transient=False
        leaves out the records whose storage exists only while in use (stage 3's gathered
        weights, a shard's NVMe buffer), which the ledger counts when they are."""
        out: dict[str, int] = {}
        for r in self.records:
            if r.tier == tier and r.alias_of is None and (transient or not r.transient):
                out[r.kind] = out.get(r.kind, 0) + r.nbytes
        return out


def geometry(numel: int, world: int, rank: int,
             shard_optimizer: bool) -> tuple[int, int, tuple[int, int], tuple[int, int]]:
    """(padded_numel, shard_numel, this rank's shard range, optimizer range): see [Note: unit
    layout] in units/unit.py. The one place a rank's shard range is computed; everything else
    reads it from the layout (`UnitLayout.shard_range`, `Unit.shard_range`)."""
    quantum = world * ALIGN
    padded = -(-numel // quantum) * quantum
    shard = padded // world
    own = (rank * shard, (rank + 1) * shard)
    return padded, shard, own, (own if shard_optimizer else (0, padded))


def weights_are_shard(world: int, shard_tier: TierName, cuda: bool) -> bool:
    """[Note: one rank's shard is its weights]
    Stage 3 gathers a unit's weights into a buffer on the compute device from this rank's shard.
    With one rank the shard is every weight, and where it lives in the compute device's own
    memory (a device shard; a host shard when the device is this host's CPU) the gather would
    copy those bytes to a second buffer in the same memory, twice per micro-step (forward and
    backward): at 1B in bf16, 2 GB each time and as much RAM again. So there the weights are the
    shard itself: nothing is gathered or released (the unit is persistent), and the optimizer
    parts write the new weights where the forward reads them, as they write the shard."""
    return world == 1 and (shard_tier is TierName.DEVICE or (shard_tier is TierName.HOST and not cuda))


def gradient_refill_bytes(layouts: list[UnitLayout]) -> int:
    """Bytes the gradient files move once more each way per step beyond one write and one read:
    every micro-step after the first reads, adds and writes them back where each micro-step
    reduces (`reductions_per_step`); none where the gradients are held in host memory."""
    again = max((lay.reductions_per_step for lay in layouts), default=1) - 1
    return again * sum(lay.bytes(TierName.NVME).get("grads", 0) for lay in layouts)


def plan_layout(numel: int, world: int, rank: int, partition: PartitionPolicy,
                placement: PlacementPolicy, compute_dtype: torch.dtype, reduce_dtype: torch.dtype,
                *, trainable: bool, grad_accum_steps: int = 1, cuda: bool = False,
                ram_left: int = 0, param_ram_left: int = 0, grad_ram_left: int = 0) -> UnitLayout:
    """The unit's buffers as records; see [Note: unit layout records]. Pure: allocates nothing.

    cuda: the compute device is a CUDA device (host buffers that cross are pinned, gradients
    land in a staging buffer). ram_left: with placement.nvme, elements of the host budget
    (offload_optimizer.max_in_cpu) the units before this one left: the offloaded range's first
    elements up to it stay in host memory, the rest is the nvme part. param_ram_left: with
    placement.params_on_nvme, elements of offload_param.max_in_cpu the units before this one
    left: a shard that fits stays in host memory, else it is a file. grad_ram_left: with
    placement.grad_ram_numel, gradient elements of offload_optimizer.nvme_gradients_max_in_cpu
    the units before this one left: an nvme part that fits holds its gradient in host memory,
    else it has a gradient file.
    """
    padded, shard_numel, own, (a, b) = geometry(numel, world, rank, partition.shard_optimizer)
    reductions = grad_accum_steps if partition.shard_gradients else 1
    fp32 = compute_dtype == torch.float32
    f32 = torch.float32
    pin_params = placement.param_pin_memory and cuda and torch.cuda.is_available()
    lo, hi = own
    shard_tier = placement.param_tier(shard_numel, param_ram_left)
    if partition.shard_weights and weights_are_shard(world, shard_tier, cuda):
        records = [BufferRecord("shard", "weights", shard_tier, compute_dtype, lo, hi),
                   BufferRecord("weights", "weights", shard_tier, compute_dtype, 0, padded,
                                alias_of="shard")]
    elif partition.shard_weights:
        records = [BufferRecord("weights", "weights", TierName.DEVICE, compute_dtype, 0, padded,
                                transient=True)]
        records.append(BufferRecord("shard", "weights", shard_tier, compute_dtype, lo, hi,
                                    pinned=pin_params and shard_tier is not TierName.NVME))
        if shard_tier is TierName.NVME:
            records.append(BufferRecord("shard_buffer", "buffers", TierName.HOST, compute_dtype,
                                        lo, hi, pinned=pin_params, transient=True))
    else:
        records = [BufferRecord("weights", "weights", TierName.DEVICE, compute_dtype, 0, padded)]
    home = "shard" if partition.shard_weights else "weights"  # where the weights persist
    if not trainable:
        return UnitLayout(numel, padded, shard_numel, own, (a, b), (), tuple(records), reductions)

    k = placement.host_numel(b - a) if placement.offloads else 0
    h = placement.ram_split(k, ram_left)  # [a, a + h) in host memory, [a + h, a + k) on NVMe
    parts = tuple(p for p in (OptimizerPart(TierName.HOST, a, a + h),
                              OptimizerPart(TierName.NVME, a + h, a + k),
                              OptimizerPart(TierName.DEVICE, a + k, b))
                  if p.numel or p.tier is TierName.DEVICE)
    if not partition.shard_gradients:
        records.append(BufferRecord("grads", "grads", TierName.DEVICE, compute_dtype, 0, padded))
    # fp32 compute: the optimizer steps the weights in place, where they live on the device.
    master_is_weights = fp32 and next(r for r in records if r.name == home).tier is TierName.DEVICE
    master = placement.master_dtype  # bf16 with bf16.bf16_master_weights_and_grads
    records.append(BufferRecord("master", "master", TierName.DEVICE, master, a + k, b,
                                alias_of=home if master_is_weights else None))
    # DDP in fp32: reduce in place in the gradient buffer, no second copy.
    grads_are_master = (not partition.shard_gradients and not partition.shard_optimizer and fp32
                        and reduce_dtype == f32 and k == 0)
    records.append(BufferRecord("master_grad", "grads", TierName.DEVICE, master, a + k, b,
                                alias_of="grads" if grads_are_master else None))
    if not partition.shard_gradients and not fp32 and grad_accum_steps > 1:
        # Stage 0: the fp32 sum of the micro-steps is the master gradient itself.
        sums_in_master = not partition.shard_optimizer and k == 0
        records.append(BufferRecord("grad_acc", "grads", TierName.DEVICE, f32, 0, padded,
                                    alias_of="master_grad" if sums_in_master else None))
    if h:
        records += _host_part_records(placement, partition, compute_dtype, a, a + h, cuda,
                                      shard_tier)
    if k > h:
        records += _nvme_part_records(placement, partition, compute_dtype, a + h, a + k, cuda,
                                      shard_tier, placement.holds_gradient(k - h, grad_ram_left))
    return UnitLayout(numel, padded, shard_numel, own, (a, b), parts, tuple(records), reductions,
                      placement.gradient_dtype)


def _host_part_records(placement: PlacementPolicy, partition: PartitionPolicy,
                       compute_dtype: torch.dtype, lo: int, hi: int, cuda: bool,
                       shard_tier: TierName) -> list[BufferRecord]:
    f32 = torch.float32
    fp32 = compute_dtype == f32
    pin = placement.pin_memory and cuda and torch.cuda.is_available()
    # offload_param without the delay: the host update writes the host shard in place.
    in_place = shard_tier is TierName.HOST and not placement.delayed and partition.shard_weights
    # bf16.bf16_master_weights_and_grads: the master and the gradient the kernel reads are bf16.
    master = placement.master_dtype
    out = [BufferRecord("host_master", "master", TierName.HOST, master, lo, hi, pinned=pin,
                        alias_of="shard" if in_place and fp32 else None)]
    # With the delayed update the worker reads one gradient buffer while the next backward fills
    # the other; without it one buffer suffices; stepped in backward, none is kept between steps
    # (parts/held_gradient.py HeldGradient).
    for i in range(0 if placement.step_in_backward else 2 if placement.delayed else 1):
        out.append(BufferRecord(f"host_grad{i}", "grads", TierName.HOST, placement.gradient_dtype,
                                lo, hi, pinned=pin))
    if not fp32:
        out.append(BufferRecord("host_out16", "buffers", TierName.HOST, compute_dtype, lo, hi,
                                pinned=pin, alias_of="shard" if in_place else None))
    if cuda:
        out.append(BufferRecord("host_staging", "buffers", TierName.HOST, f32, lo, hi,
                                pinned=torch.cuda.is_available()))
    return out


def _nvme_part_records(placement: PlacementPolicy, partition: PartitionPolicy,
                       compute_dtype: torch.dtype, lo: int, hi: int, cuda: bool,
                       shard_tier: TierName, held: bool) -> list[BufferRecord]:
    """ZeRO-Infinity's part: the master and gradient in files, in placement.master_dtype (the
    optimizer state joins at bind, in placement.state_dtype), as DeepSpeed swaps them; the new compute-dtype weights in host memory
    (parts/nvme_executor.py). Gradients reach their file through small host buffers
    (parts/nvme.py), so no record of the part's size is needed for them in RAM."""
    master = placement.master_dtype  # bf16.bf16_master_weights_and_grads: 2 bytes per element
    pin = placement.pin_memory and cuda and torch.cuda.is_available()
    # offload_param without the delay: the stream writes the new weights into the host shard
    # itself, as the host part does (no second 16-bit copy of the part in RAM).
    in_place = shard_tier is TierName.HOST and not placement.delayed and partition.shard_weights
    # With the delayed update the stream reads one gradient file while backward writes the other;
    # `held` (stepped in backward, or nvme_gradients 'host' within its max_in_cpu): the gradient
    # is held in host memory until stepped (no file).
    grads = [BufferRecord(f"nvme_grad{i}", "grads", TierName.NVME, placement.gradient_dtype, lo, hi)
             for i in range(0 if held else 2 if placement.delayed else 1)]
    records = [BufferRecord("nvme_master", "master", TierName.NVME, master, lo, hi), *grads]
    if shard_tier is not TierName.NVME:  # the step's new weights, written back to the weights'
        # home after the stream (a shard on NVMe: the stream writes them to its file a sub-group
        # at a time)
        records.append(BufferRecord("nvme_out", "buffers", TierName.HOST, compute_dtype, lo, hi,
                                    pinned=pin, alias_of="shard" if in_place else None))
    return records
