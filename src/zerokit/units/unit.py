"""Unit: a group of parameters that are gathered, reduced and stepped together.

[Note: unit layout]
A unit's parameters are laid end to end in one flat buffer of `padded_numel` elements, padded so
that it splits into `world_size` equal shards whose length is a multiple of ALIGN elements; rank r
owns elements [r * shard_numel, (r + 1) * shard_numel). The users' nn.Parameters stay in place and
become views into the flat compute buffer, so models need no refactoring and `p.shape` stays the
logical shape. Padding elements have zero weight, zero gradient and therefore zero update.

[Note: unit state per rank]
Which buffers a unit holds, on which tier, over which elements, and which are views of which,
is decided by one pure function, policy/layout.py `plan_layout` ([Note: unit layout records]); the
Unit allocates them from its tiers and keeps these names for them:
- `flat`        compute-dtype weights, full size. At stage 3 its storage exists only while the
                unit is gathered (resized to 0 bytes when released), so parameter views keep their
                logical shapes and autograd's saved tensors see the weights again when re-gathered.
- `shard`       stage 3: this rank's compute-dtype shard, the persistent copy of the weights, on
                the device or (offload_param) the host tier; gathering first copies it into this
                rank's slot of `flat`. With offload_param nvme it is a host buffer with storage
                only while the values pass through, and `nvme_shard` holds the file
                ([Note: weight shards on NVMe] in tiers/nvme_shard.py).
While released, each parameter's `.data` is a NaN placeholder of its logical shape that owns one
element (zero strides): `p.shape` stays true, reading it cannot crash, computing with it is
visibly wrong, and writing to it raises. Gathering points the parameters back into `flat`.
- `grad_flat`   compute-dtype full-size gradients that `p.grad` views point into; only where
                gradients are reduced once per accumulation boundary (not sharded).
- `parts`       the optimizer range as parts ([Note: optimizer parts] in parts/__init__.py): with
                offload a HostPart (parts/host.py: master, optimizer state, gradient on the
                host tier) for the first `host_numel` elements, with offload_optimizer nvme an
                NvmePart (parts/nvme.py: the same in files) for the next `nvme_numel`, then
                always a DevicePart (parts/device.py) for the rest.
- `master`      the device part's fp32 weights (bf16 with bf16.bf16_master_weights_and_grads):
                this rank's shard of the optimizer range if the optimizer state is
                partitioned, the whole buffer otherwise; in fp32 training a
                view of the weights. `master_grad`: its reduced gradient, which the optimizer
                reads (stage 0 in fp32: a view of `grad_flat`).
- `grad_acc`    fp32 full-size sum of the micro-steps' 16-bit gradients before the boundary, where
                gradients are reduced only there (stage < 2, 16-bit compute, accumulation > 1):
                16-bit running sums would lose what DeepSpeed's fp32 accumulation keeps. At
                stage 0 it is `master_grad` itself.
`state` ([Note: state machines] in states.py) says where the full weights are.

The gradient reduction (backward's side of a unit) is units/reduction.py ([Note: one reduction,
one meaning] there).

`master.grad` is linked to `master_grad` only while torch's optimizer steps (see
DeviceExecutor.launch in parts/executors.py): user code that resets `.grad` between steps (`optimizer.zero_grad()`)
then neither unlinks nor zeroes what the step reads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from zerokit.comm.collectives import Comm, Handle, require_backed
from zerokit.io import huge_pages
from zerokit.io.buffers import ALIGN, aligned_empty
from zerokit.policy.layout import UnitLayout, plan_layout
from zerokit.units.lease import ReadLease
from zerokit.units.reduction import GradientReduction
from zerokit.units.registry import hold, let_go
from zerokit.parts.device import DevicePart
from zerokit.parts.host import HostPart
from zerokit.states import WeightState, move
from zerokit.policy import PartitionPolicy, PlacementPolicy
from zerokit.tiers import Ledger, TierName, tiers_for
from zerokit.tiers.transfer import side_stream, uses_streams


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its unit's flat buffer."""

    fqn: str
    param: nn.Parameter
    shape: torch.Size
    offset: int
    numel: int


class Unit(GradientReduction):
    # Factors of the gradient reduction, a sum: (before it, after it); None after means average.
    # prescale_gradients / gradient_predivide_factor set them (ZeroKitConfig.gradient_reduction_scales).
    grad_scales: tuple[float, float | None] = (1.0, None)
    # zero_optimization.enable_sanity_checks: GatheredParameters without modifier_rank refuses edits.
    sanity_checks: bool = False

    def __init__(self, name: str, params: list[tuple[str, nn.Parameter]], *, module: nn.Module | None,
                 trainable: bool,
                 group_index: int, comm: Comm, policy: PartitionPolicy, compute_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, bucket_numel: int, ledger: Ledger,
                 grad_accum_steps: int = 1, placement: PlacementPolicy | None = None,
                 layout: UnitLayout | None = None, nvme=None):
        """placement: where the buffers live (default: all on the device); layout: the records
        to allocate, when the caller planned them already (initialize checks their host bytes
        first); else planned here from the sizes and both policies."""
        if not params:
            raise ValueError(f"unit {name!r} has no parameters")
        self.name = name
        # whose forward uses these weights first (the model for the root unit); None for zero.Init's
        # construction units, which must not keep their module alive
        self.module = module
        self.trainable = trainable
        self.group_index = group_index
        self.comm = comm
        self.policy = policy
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.bucket_numel = bucket_numel
        self.ledger = ledger
        self.grad_accum_steps = grad_accum_steps

        slots, offset = [], 0
        for fqn, p in params:
            slots.append(ParamSlot(fqn, p, p.shape, offset, p.numel()))
            offset += p.numel()
        self.slots: list[ParamSlot] = slots
        self.numel = offset
        self.device = comm.device
        if layout is None:
            layout = plan_layout(offset, comm.world_size, comm.rank, policy,
                                 placement or PlacementPolicy(), compute_dtype, reduce_dtype,
                                 trainable=trainable, grad_accum_steps=grad_accum_steps,
                                 cuda=self.device.type == "cuda")
        if layout.numel != offset:
            raise ValueError(f"unit {name!r}: layout planned for {layout.numel} elements, the "
                             f"parameters have {offset}")
        self.layout = layout
        # [Note: one rank's shard is its weights] in policy/layout.py
        self.weights_are_shard = layout.aliases("weights", "shard")
        self.padded_numel, self.shard_numel = layout.padded_numel, layout.shard_numel
        self.shard_range = layout.shard_range  # this rank's elements [lo, hi) of the flat index space
        self.opt_range = layout.opt_range
        self._release_bytes = None  # ledger release of the gathered full weights (stage 3)
        self._sync_initial_values()
        self._retired = False  # zero.Init's construction units give their parameters away
        self._tiers = tiers_for(ledger, self.device, nvme)  # nvme: the NvmeTier, if any
        self._allocate(self._tiers)
        self._ready: set[int] = set()
        self._launched = False
        self.used = False  # got a gradient since the last step (see Engine._skip_unused)
        self._gather_handle: Handle | None = None
        self._fetch_stream = None  # CUDA side stream a host shard's gather runs on (offload_param)
        self.index = -1  # position in the engine's unit list; set by the engine
        # the timeline's phase names for this unit's forward and recomputation, made once
        # ([Note: the memory timeline] in tiers/timeline.py)
        self.phase_names = (f"forward {name}", f"recompute {name}")
        # stage 3 decides per unit (small ones stay); never gathered where the shard is the weights
        self.persistent = not policy.shard_weights or self.weights_are_shard
        self.reduce_at_end = False  # holds a leaf module: reduced at end of backward ([Note: leaf modules])
        self.lease = ReadLease()  # readers of this unit's state in flight; its engine's, shared (units/lease.py)

    # ---- construction -----------------------------------------------------------------------
    def _allocate(self, tiers: dict) -> None:
        """Allocate the layout's records (see [Note: unit layout records] in policy/layout.py) and
        fill them from the parameters' current values; fp32 values become the masters exactly."""
        bufs: dict[str, torch.Tensor] = {}
        # [Note: reading into the weights] in tiers/nvme_shard.py: a shard on NVMe is read straight
        # into `flat` where that is host memory that can keep its address while released
        self.reads_in_place = self._can_read_in_place()
        self.keeps_address = self.reads_in_place or self._can_keep_address()
        for r in self.layout.records:
            if r.alias_of is not None:
                target = self.layout.record(r.alias_of)
                bufs[r.name] = bufs[r.alias_of][r.lo - target.lo:r.hi - target.lo]
            elif r.transient and r.tier is TierName.HOST:  # a shard's host buffer (tiers/nvme_shard.py)
                from zerokit.parts.nvme import host_buffer

                bufs[r.name] = host_buffer(r.numel, r.dtype)
            elif r.transient and r.name == "weights" and self.keeps_address:
                # one address for the unit's life; aligned_empty asks for 2 MiB pages, and the
                # range keeps that advice through every release, so each gather faults in huge
                # pages (a 0.58B GPT's forward: 8K faults, not 300K)
                nbytes = r.numel * r.dtype.itemsize
                bufs[r.name] = aligned_empty(nbytes).view(r.dtype).zero_()
            elif r.transient:  # counted while it has storage (see gather / _free_flat)
                bufs[r.name] = torch.zeros(r.numel, dtype=r.dtype, device=self.device)
            else:
                bufs[r.name] = tiers[r.tier].allocate(f"{self.name}/{r.name}", r.kind, r.numel,
                                                      r.dtype, pinned=r.pinned)
        flat = bufs["weights"]
        for r in self.layout.records:  # masters from the parameters, before they point into flat
            if r.kind == "master" and r.alias_of is None and r.tier is TierName.NVME:
                from zerokit.parts.nvme import fill_range, host_buffer  # the I/O engine: only with NVMe

                staged = host_buffer(r.numel, r.dtype)  # one part's master in RAM, then to its file
                self._copy_param_values(staged, r.lo, r.hi)
                fill_range(tiers[TierName.NVME], bufs[r.name], staged)
            elif r.kind == "master" and r.alias_of is None:
                self._copy_param_values(bufs[r.name], r.lo, r.hi)
        self._copy_param_values(flat, 0, self.padded_numel)
        self.flat = flat
        for s in self.slots:
            s.param.data = flat[s.offset:s.offset + s.numel].view(s.shape)
            s.param.grad = None
            hold(s.param, self)
        self.nvme_shard = None  # offload_param nvme: the shard's file (tiers/nvme_shard.py)
        if isinstance(bufs.get("shard"), torch.Tensor) or "shard" not in bufs:
            self.shard: torch.Tensor | None = bufs.get("shard")
        else:
            from zerokit.tiers.nvme_shard import NvmeShard

            self.shard = bufs["shard_buffer"]
            lo, hi = self.shard_range
            self.nvme_shard = NvmeShard(tiers[TierName.NVME], bufs["shard"], self.shard, self.ledger,
                                        slot=flat[lo:hi] if self.reads_in_place else None)
        self._placeholder = torch.full((1,), float("nan"), dtype=self.compute_dtype, device=self.device)
        self._state = WeightState.GATHERED
        if self.shard is not None and not self.weights_are_shard:
            lo, hi = self.shard_range
            self.shard.copy_(flat[lo:hi])
            if self.nvme_shard is not None:
                self.nvme_shard.write_values(self.shard)
                self.nvme_shard.drop_clean()
            self._free_flat()
        self.grad_flat: torch.Tensor | None = bufs.get("grads")
        self.grad_acc: torch.Tensor | None = bufs.get("grad_acc")
        self.parts: list = []
        self.master: torch.Tensor | None = None
        self.master_grad: torch.Tensor | None = None
        if not self.trainable:
            return
        home = self.shard if self.shard is not None else flat
        if self.nvme_shard is not None:  # the parts write new weights straight to the file
            home = self.nvme_shard.home
        home_lo = self.layout.record("shard" if self.shard is not None else "weights").lo
        host = next((p for p in self.layout.parts if p.tier is TierName.HOST), None)
        if host is not None:
            out = "host_out16" if self.layout.has("host_out16") else "host_master"
            self.parts.append(HostPart(self, host, bufs, tiers[TierName.HOST],
                                       home[host.lo - home_lo:host.hi - home_lo],
                                       in_place=self.layout.aliases(out, "shard"),
                                       pinned=self.layout.record("host_master").pinned))
        nvme = next((p for p in self.layout.parts if p.tier is TierName.NVME), None)
        if nvme is not None:
            from zerokit.parts.nvme import NvmePart

            grad_files = [bufs[n] for n in ("nvme_grad0", "nvme_grad1") if n in bufs]
            self.parts.append(NvmePart(self, nvme, master=bufs["nvme_master"], grad_files=grad_files,
                                       out16=bufs.get("nvme_out"), nvme=tiers[TierName.NVME],
                                       home=home[nvme.lo - home_lo:nvme.hi - home_lo],
                                       in_place=self.layout.aliases("nvme_out", "shard"),
                                       pinned=self.layout.has("nvme_out") and self.layout.record("nvme_out").pinned))
        span = self.layout.parts[-1]
        self.master = nn.Parameter(bufs["master"], requires_grad=True)
        self.master_grad = bufs["master_grad"]
        self.parts.append(DevicePart(span, self.master, self.master_grad,
                                     home[span.lo - home_lo:span.hi - home_lo],
                                     in_place=self.layout.record("master").alias_of is not None,
                                     shard_gradients=self.policy.shard_gradients))
        if self.grad_flat is not None:
            self._attach_grad_views()

    def _copy_param_values(self, dest: torch.Tensor, lo: int, hi: int) -> None:
        """dest <- the parameters' values over elements [lo, hi) of the flat index space."""
        for s in self.slots:
            a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
            if a < b:
                # A parameter left viewing freed memory (see comm.collectives.require_backed)
                # would be read as whatever lies there now: refuse it.
                require_backed(s.param.detach(), "laying out", f"{self.name} ({s.fqn})")
                src = s.param.detach().reshape(-1)[a - s.offset:b - s.offset]
                dest[a - lo:b - lo].copy_(src)

    @property
    def host_numel(self) -> int:
        """Elements [a, a + host_numel) of the optimizer range step on the host."""
        return self.layout.host_numel

    def _attach_grad_views(self) -> None:
        self._grad_views = [self.grad_flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots]
        for s, view in zip(self.slots, self._grad_views):
            s.param.grad = view

    def _sync_initial_values(self) -> None:
        """Every rank starts from rank 0's weights, as DDP does (seeds may differ per rank).

        One broadcast per parameter, in place: a concatenated copy would double the peak of the
        largest unit, which zero.Init's per-rank budget cannot afford.
        """
        if self.comm.world_size == 1:
            return
        for s in self.slots:
            self.comm.broadcast_(s.param.data, src=0, where=f"{self.name} ({s.fqn})")

    # ---- step ---------------------------------------------------------------------------------
    def grad_sq_norm(self) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for part in self.parts:
            total = total + part.grad_sq_norm()
        return total

    def publish_weights(self) -> None:
        """After the optimizer step: new master -> compute weights -> every rank (asynchronous).

        [Note: weights in flight] While GATHERING, the parts of `flat` other ranks own are being
        gathered and must not be read: the engine waits before `step()` returns (user code may
        read any parameter then), so the gathers overlap only the rest of the step. With
        zero_optimization.async_weight_publish it waits later instead: in the unit's forward
        pre-hook, before any state_dict, and before the next backward or step.
        """
        # Host parts were written back by their executor; the device part is written here.
        self.parts[-1].write_weights()
        if self.shard is not None and self.state is WeightState.SHARDED:
            return  # stage 3: the next gather reads the new shard
        if (self.shard is None and not self.policy.shard_optimizer) or self.weights_are_shard:
            return  # every rank stepped the whole unit (or the one rank its weights): no gather
        self.wait_weights()  # a gather still in flight lands before the new one starts
        self._start_gather()  # persistent / still-gathered units gather anew

    # ---- a weight shard on NVMe ([Note: weight shards on NVMe] in tiers/nvme_shard.py) ---------
    def _can_read_in_place(self) -> bool:
        """A shard on NVMe, `flat` in host memory whose pages can be handed back while it keeps
        its address, and this rank's range of it on a sector (O_DIRECT reads straight into it)."""
        if self.device.type != "cpu" or not huge_pages.can_release():
            return False
        if not any(r.name == "shard_buffer" for r in self.layout.records):
            return False
        lo = self.shard_range[0]
        return lo * self.compute_dtype.itemsize % ALIGN == 0

    def _can_keep_address(self) -> bool:
        """[Note: gathered weights keep their address]
        Stage 3 on a CPU device: `flat` is allocated once and its pages are handed back to the
        kernel at every release (MADV_DONTNEED), instead of its storage being freed and allocated
        again at every gather. Freed, a unit's buffer went back to malloc's heap (whose threshold
        for mapping large blocks rises with each such free), and the gathers, reductions and
        activations after it came from a heap the process's RSS does not give back: bench_step's
        stage 3 peaked at DDP's RSS while holding less. Kept, RSS drops at each release and the
        pages fault in again at the gather, as fresh memory did (in 2 MiB pages where the system
        allows). Measured (bench_step --compare, 2 gloo ranks, GPT 6 x 512, 4 rounds each way):
        peak RSS 892 MiB against 932, step time 1.035x and 0.963x in two runs (noise). Autograd's
        saved views of the weights read the regathered values either way (same storage object)."""
        return (self.device.type == "cpu" and huge_pages.can_release()
                and any(r.name == "weights" and r.transient for r in self.layout.records))

    def fetch(self) -> None:
        """Start reading the shard from NVMe (a prefetch); nothing for a shard in memory."""
        if self.nvme_shard is not None and self.state is WeightState.SHARDED:
            self.nvme_shard.fetch(into_slot=True)

    def shard_values(self) -> torch.Tensor:
        """This rank's shard of the compute weights (read from its file if on NVMe)."""
        if self.nvme_shard is None:
            return self.shard
        return self.nvme_shard.ready().clone()

    @property
    def state(self) -> WeightState:
        return self._state

    def _move(self, new: WeightState) -> None:
        self._state = move(self._state, new, f"unit '{self.name}' weights")

    def gather(self) -> None:
        """Start gathering the full weights into `flat` (stage 3, or a re-publish); idempotent."""
        if self.state is not WeightState.SHARDED:
            return
        if self.nvme_shard is not None:  # read from NVMe first (or wait for the prefetch's read)
            self.nvme_shard.ready(into_slot=True)
        nbytes = self.padded_numel * self.flat.element_size()
        if self.keeps_address:  # its pages, handed back at release, fault in again
            self._release_bytes = self.ledger.transient("weights", self.flat)
        elif self.flat.untyped_storage().nbytes() != nbytes:  # a device's allocator's memory
            self.flat.untyped_storage().resize_(nbytes)
            self._release_bytes = self.ledger.transient("weights", self.flat)
        self._start_gather()

    def _start_gather(self) -> None:
        """This rank's part of `flat` from its home, then the all-gather (asynchronous)."""
        self._move(WeightState.GATHERING)
        if self.shard is None:  # stage 1-2: the step wrote this rank's range of `flat` itself
            self._gather_handle = self.comm.all_gather(self.flat, self.name, async_op=True,
                                                       unit=self.index)
            return
        lo, hi = self.shard_range
        own = self.flat[lo:hi]  # this rank's slot: the all-gather's input
        if self.nvme_shard is not None:
            # From NVMe through the host buffer: waits for its read (or reads now). The buffer is
            # freed once copied (on CUDA the pinned allocator keeps it until the copy is done).
            # Read in place, the values are in `own` already ([Note: reading into the weights]).
            values = self.nvme_shard.ready(into_slot=True)
            if values.data_ptr() != own.data_ptr():
                own.copy_(values, non_blocking=self.nvme_shard.buffer.is_pinned())
            self.nvme_shard.drop_clean()
            self._gather_handle = self.comm.all_gather(self.flat, self.name, async_op=True,
                                                       unit=self.index)
            return
        if self.shard.device == own.device or not uses_streams(own):
            # A device shard; or offload_param on a CPU-only machine, where this is the same
            # host -> "device" copy between two buffers, synchronous. Only with several ranks:
            # one rank's shard there is the weights and never gathered (policy/layout.py).
            own.copy_(self.shard)
            self._gather_handle = self.comm.all_gather(self.flat, self.name, async_op=True,
                                                       unit=self.index)
            return
        # offload_param on CUDA: the (pinned) host shard crosses on the side stream and the
        # all-gather is queued behind it there, so a prefetch overlaps the compute stream;
        # wait_weights orders the compute stream after both.
        side = side_stream(own.device)
        side.wait_stream(torch.cuda.current_stream(own.device))  # `flat` was just allocated there
        with torch.cuda.stream(side):
            own.copy_(self.shard, non_blocking=True)
            self._gather_handle = self.comm.all_gather(self.flat, self.name, async_op=True,
                                                       unit=self.index)
        self._fetch_stream = side

    def wait_weights(self) -> None:
        if self.nvme_shard is not None:  # the step's write of the shard lands, its buffer freed
            self.nvme_shard.settle()
        if self.state is WeightState.GATHERING:
            handle, self._gather_handle = self._gather_handle, None
            handle.wait()
            if self._fetch_stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self._fetch_stream)
                self._fetch_stream = None
            self._move(WeightState.GATHERED)
            if self.shard is not None:
                self._point_params_at(self.flat)

    def _point_params_at(self, flat: torch.Tensor | None) -> None:
        for s in self.slots:
            if flat is None:
                s.param.data = self._placeholder.expand(s.shape)
            else:
                s.param.data = flat[s.offset:s.offset + s.numel].view(s.shape)

    def release(self, persistent_too: bool = False) -> None:
        """Drop the full weights, keeping the shard (stage 3; persistent units only when
        persistent_too: engine.empty_partition_cache, whose next use gathers them again)."""
        if self.shard is None or self.state is WeightState.SHARDED or self.weights_are_shard:
            return  # below stage 3 (or where the shard is the weights) they are the only copy
        if self.persistent and not persistent_too:
            return
        self.wait_weights()
        self._free_flat()

    def absorb_edits(self) -> None:
        """`flat` was edited (and made equal on every rank): carry the edit into shard and master.

        Master elements whose 16-bit rounding did not change keep their fp32 value, so gathering
        to read (or to edit a few weights) does not lose the master's precision elsewhere.
        """
        if self.shard is not None and not self.weights_are_shard:
            lo, hi = self.shard_range
            if self.nvme_shard is not None:
                self.nvme_shard.write_values(self.flat[lo:hi])
            else:
                self.shard.copy_(self.flat[lo:hi])
        for part in self.parts:
            part.absorb(self.flat[part.lo:part.hi])

    def retire(self) -> None:
        """Give up the parameters to another unit (zero.Init's construction units): free our
        buffers and forget the parameters without touching their `.data`. Idempotent (an
        adopted unit is retired again with the model's orphans)."""
        if self._retired:
            return
        self.wait_weights()  # a gather in flight still writes into `flat`: never free under it
        self._retired = True
        for s in self.slots:
            let_go(s.param, self)
        self.flat.untyped_storage().resize_(0)
        if self.nvme_shard is not None:
            self.nvme_shard.close()
            self.nvme_shard = None
        self.shard = None
        for r in self.layout.records:  # what the tiers allocated leaves the ledger with them
            if r.alias_of is None and not r.transient:
                self._tiers[r.tier].free(f"{self.name}/{r.name}")
        if self.state is not WeightState.SHARDED:
            self._move(WeightState.SHARDED)
        if self._release_bytes is not None:
            self._release_bytes()
            self._release_bytes = None

    def _free_flat(self) -> None:
        self._point_params_at(None)
        if self.keeps_address:  # the pages go, the address stays ([Note: gathered weights keep their address])
            huge_pages.release(self.flat.data_ptr(), self.flat.numel() * self.flat.element_size())
        else:
            self.flat.untyped_storage().resize_(0)
        self._move(WeightState.SHARDED)
        if self._release_bytes is not None:
            self._release_bytes()
            self._release_bytes = None

    def zero_grad(self) -> None:
        self.used = False
        for part in self.parts:
            part.zero_grad()
        if self.grad_acc is not None:
            self.grad_acc.zero_()
        if self.grad_flat is not None:
            self.grad_flat.zero_()
            self._attach_grad_views()
        else:
            for s in self.slots:
                s.param.grad = None

    def full_master(self) -> torch.Tensor:
        """The whole unit's fp32 weights (master where there is one), gathered on every rank."""
        full = torch.zeros(self.padded_numel, dtype=torch.float32, device=self.device)
        if self.trainable:
            for part in self.parts:
                full[part.lo:part.hi].copy_(part.master_values())
            partitioned = self.policy.shard_optimizer
        elif self.shard is not None:
            lo, hi = self.shard_range
            full[lo:hi].copy_(self.shard_values())
            partitioned = True
        else:
            return self.flat.float()
        if partitioned:
            self.comm.all_gather(full, self.name, unit=self.index)
        return full

    def split(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        """fqn -> that parameter's view of a flat buffer laid out like this unit."""
        return {s.fqn: full[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots}

    # ---- introspection ------------------------------------------------------------------------
    def param_fqns(self) -> list[str]:
        return [s.fqn for s in self.slots]

    def __repr__(self) -> str:
        return (f"Unit({self.name!r}, params={len(self.slots)}, numel={self.numel}, "
                f"padded={self.padded_numel}, trainable={self.trainable}, group={self.group_index})")
