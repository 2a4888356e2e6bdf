"""Unit: a group of parameters that are gathered, reduced and stepped together.

[Note: unit layout]
A unit's parameters are laid end to end in one flat buffer of `padded_numel` elements, padded so
that it splits into `world_size` equal shards whose length is a multiple of ALIGN elements; rank r
owns elements [r * shard_numel, (r + 1) * shard_numel). The users' nn.Parameters stay in place and
become views into the flat compute buffer, so models need no refactoring and `p.shape` stays the
logical shape. Padding elements have zero weight, zero gradient and therefore zero update.

[Note: unit state per rank]
- `flat`        compute-dtype weights, full size. At stage 3 its storage exists only while the
                unit is gathered (resized to 0 bytes when released), so parameter views keep their
                logical shapes and autograd's saved tensors see the weights again when re-gathered.
- `shard`       stage 3: this rank's compute-dtype shard, the persistent copy of the weights.
                With offload_param it lives on the host tier (see engine/offload.py
                place_weight_shards) and gathering first copies it into this rank's slot of `flat`.
While released, each parameter's `.data` is a NaN placeholder of its logical shape that owns one
element (zero strides): `p.shape` stays true, reading it cannot crash, computing with it is
visibly wrong, and writing to it raises. Gathering points the parameters back into `flat`.
- `grad_flat`   compute-dtype full-size gradients that `p.grad` views point into; only where
                gradients are reduced once per accumulation boundary (not sharded).
- `master`      fp32 weights of the optimizer range: this rank's shard if the optimizer state is
                partitioned, the whole buffer otherwise. In fp32 training it aliases `flat`.
- `master_grad` fp32 reduced gradient of the optimizer range, the `.grad` the optimizer reads.
- `host`        with offload (see zerokit.engine.offload.HostShard): the first `host_numel`
                elements of the optimizer range have their fp32 master, optimizer state and
                gradient on the host tier; `master` and `master_grad` then cover only the rest
                (the device part), elements [host_numel, len(opt_range)).
- `grad_acc`    fp32 full-size sum of the micro-steps' 16-bit gradients before the boundary, where
                gradients are reduced only there (stage < 2, 16-bit compute, accumulation > 1):
                16-bit running sums would lose what DeepSpeed's fp32 accumulation keeps. At
                stage 0 it is `master_grad` itself.

[Note: one reduction, one meaning]
Below stage 2 a rank's gradients are summed locally over the micro-steps (in `grad_acc` where it
exists, else in `grad_flat`) and reduced once, at the boundary: the reduced average *is* the
step's gradient, so it is written into `master_grad`, never added to it. From stage 2 on, every
micro-step is reduced and each average is added into `master_grad`. Written this way, the aliases
above (stage 0: `master_grad` is `grad_flat` in fp32, is `grad_acc` with 16-bit accumulation) are
harmless whatever the reduce dtype: the collective runs in place on the local sum, or on a copy
of it in the reduce dtype that is then written back over it. Adding instead would leave
`master_grad` = local sum + global average wherever the local sum lives in `master_grad` and
crosses in another dtype (issue #14).

`master.grad` is linked to `master_grad` by the engine only while the optimizer steps (see
Engine._run_optimizer): user code that resets `.grad` between steps (`optimizer.zero_grad()`)
then neither unlinks nor zeroes what the step reads.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn as nn

from zerokit.core.collectives import Comm, Handle
from zerokit.policy import PartitionPolicy
from zerokit.tiers import Ledger
from zerokit.tiers.transfer import side_stream, uses_streams

ALIGN = 32  # elements per shard boundary: keeps every shard 64-byte aligned for SIMD kernels


# Which unit holds a parameter, for GatheredParameters and zero.Init. The lookup keeps neither
# alive: the value is weak, so a dropped engine's units (and their buffers) are freed, and the
# key is id(param), which no other object can take while the unit lives, since the unit holds
# its parameters. (A WeakKeyDictionary keyed by the parameter would compare tensors with ==,
# which is element-wise.)
_UNIT_OF: "weakref.WeakValueDictionary[int, Unit]" = weakref.WeakValueDictionary()


def unit_of(param: torch.Tensor) -> "Unit | None":
    return _UNIT_OF.get(id(param))


class WeightState(Enum):
    """Where a unit's full compute weights are. Legal moves: SHARDED -> GATHERING -> GATHERED ->
    SHARDED (release); a gather of a GATHERING/GATHERED unit and a release of a SHARDED one are
    no-ops, so hooks may ask twice (a module called twice, a tied weight)."""

    SHARDED = "sharded"      # only this rank's shard exists; `flat` has no storage (stage 3)
    GATHERING = "gathering"  # an all-gather into `flat` is in flight: do not read `flat`
    GATHERED = "gathered"    # `flat` holds every rank's shard: parameters can be used


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its unit's flat buffer."""

    fqn: str
    param: nn.Parameter
    shape: torch.Size
    offset: int
    numel: int


class Unit:
    def __init__(self, name: str, params: list[tuple[str, nn.Parameter]], *, module: nn.Module | None,
                 trainable: bool,
                 group_index: int, comm: Comm, policy: PartitionPolicy, compute_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, bucket_numel: int, ledger: Ledger,
                 grad_accum_steps: int = 1):
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
        quantum = comm.world_size * ALIGN
        self.padded_numel = -(-offset // quantum) * quantum
        self.shard_numel = self.padded_numel // comm.world_size
        shard_start = comm.rank * self.shard_numel
        if policy.shard_optimizer:
            self.opt_range = (shard_start, shard_start + self.shard_numel)
        else:
            self.opt_range = (0, self.padded_numel)
        self.device = comm.device
        self._release_bytes = None  # ledger release of the gathered full weights (stage 3)
        self._sync_initial_values()
        self._build_buffers()
        self._ready: set[int] = set()
        self._launched = False
        self.used = False  # got a gradient since the last step (see Engine._skip_unused)
        self._gather_handle: Handle | None = None
        self._fetch_stream = None  # CUDA side stream a host shard's gather runs on (offload_param)
        self.index = -1  # position in the engine's unit list; set by the engine
        self.persistent = not policy.shard_weights  # stage 3 decides per unit (small ones stay)
        self.host = None  # offload: the host part of the optimizer range (HostShard), if any
        self.host_numel = 0
        self.reduce_at_end = False  # holds a leaf module: reduced at end of backward ([Note: leaf modules])

    # ---- construction -----------------------------------------------------------------------
    def _build_buffers(self) -> None:
        device, first = self.device, self.slots[0].param
        master_full = None
        # Build from the parameters' current values; fp32 values become the master exactly.
        flat = torch.zeros(self.padded_numel, dtype=self.compute_dtype, device=device)
        keep_fp32 = self.trainable and self.compute_dtype != torch.float32
        if keep_fp32:
            a, b = self.opt_range
            master_full = torch.zeros(b - a, dtype=torch.float32, device=device)
        for s in self.slots:
            src = s.param.detach().reshape(-1)
            flat[s.offset:s.offset + s.numel].copy_(src)
            if master_full is not None:
                lo, hi = max(s.offset, self.opt_range[0]), min(s.offset + s.numel, self.opt_range[1])
                if lo < hi:
                    master_full[lo - self.opt_range[0]:hi - self.opt_range[0]].copy_(
                        src[lo - s.offset:hi - s.offset].to(device=device, dtype=torch.float32))
        del first
        self.flat = flat
        for s in self.slots:
            s.param.data = flat[s.offset:s.offset + s.numel].view(s.shape)
            s.param.grad = None
            _UNIT_OF[id(s.param)] = self
        self.shard: torch.Tensor | None = None
        self._placeholder = torch.full((1,), float("nan"), dtype=self.compute_dtype, device=device)
        self.state = WeightState.GATHERED
        if self.policy.shard_weights:
            lo = self.comm.rank * self.shard_numel
            self.shard = self.ledger.hold(f"{self.name}/weights", "weights",
                                          flat[lo:lo + self.shard_numel].clone())
            self._free_flat()
        else:
            self.ledger.hold(f"{self.name}/weights", "weights", flat)

        self.grad_flat: torch.Tensor | None = None
        self.master: torch.Tensor | None = None
        self.master_grad: torch.Tensor | None = None
        self.grad_acc: torch.Tensor | None = None
        if not self.trainable:
            return
        a, b = self.opt_range
        if master_full is None:  # fp32 training: the optimizer updates the weights in place
            home = self.shard if self.shard is not None else flat[a:b]
            self.master = nn.Parameter(home, requires_grad=True)
        else:
            self.master = nn.Parameter(self.ledger.hold(f"{self.name}/master", "master", master_full))
        if not self.policy.shard_gradients:
            self.grad_flat = self.ledger.hold(f"{self.name}/grads", "grads", torch.zeros_like(flat))
            self._attach_grad_views()
        if self.grad_flat is not None and not self.policy.shard_optimizer and \
                self.compute_dtype == torch.float32 and self.reduce_dtype == torch.float32:
            self.master_grad = self.grad_flat  # DDP in fp32: reduce in place, no second copy
        else:
            self.master_grad = self.ledger.hold(
                f"{self.name}/master_grad", "grads", torch.zeros(b - a, dtype=torch.float32, device=device))
        if self.grad_flat is not None and self.compute_dtype != torch.float32 and self.grad_accum_steps > 1:
            self.grad_acc = self.master_grad if not self.policy.shard_optimizer else self.ledger.hold(
                f"{self.name}/grad_acc", "grads", torch.zeros(self.padded_numel, dtype=torch.float32,
                                                              device=device))

    def _attach_grad_views(self) -> None:
        for s in self.slots:
            s.param.grad = self.grad_flat[s.offset:s.offset + s.numel].view(s.shape)

    def _sync_initial_values(self) -> None:
        """Every rank starts from rank 0's weights, as DDP does (seeds may differ per rank).

        One broadcast per parameter, in place: a concatenated copy would double the peak of the
        largest unit, which zero.Init's per-rank budget cannot afford.
        """
        if self.comm.world_size == 1:
            return
        for s in self.slots:
            self.comm.broadcast_(s.param.data, src=0, where=f"{self.name} ({s.fqn})")

    # ---- backward -----------------------------------------------------------------------------
    def on_grad_ready(self, param: nn.Parameter, index: int, reduce_now: bool) -> bool:
        """Called from the post-accumulate-grad hook; True once all arrived and it is time to
        reduce (the engine then launches the reduction)."""
        slot = self.slots[index]
        if self.grad_flat is not None:
            view = self.grad_flat[slot.offset:slot.offset + slot.numel]
            if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                # Someone reset .grad (model.zero_grad()) and autograd handed us a new tensor with
                # this backward's gradient only: the view still holds the earlier micro-steps'.
                if param.grad is not None:
                    view.add_(param.grad.reshape(-1))
                param.grad = view.view(slot.shape)
        self._ready.add(index)
        self.used = True
        return reduce_now and not self.reduce_at_end and len(self._ready) == len(self.slots)

    def launch_reduce(self) -> Handle:
        """Reduce this unit's gradients into `master_grad` (asynchronously)."""
        self._launched = True
        if self.grad_flat is not None:
            # The full gradient is scratch from here on (zeroed after the step), so reduce in place.
            local = self.grad_flat
            if self.grad_acc is not None:
                local = self.grad_acc.add_(self.grad_flat)
            full = local if local.dtype == self.reduce_dtype else local.to(self.reduce_dtype)
        else:
            # Not zeros: the gradients overwrite nearly all of it, so zero only what they do not
            # (a parameter without a gradient, the padding); one pass over the bucket, not two.
            full = torch.empty(self.padded_numel, dtype=self.reduce_dtype, device=self.device)
            for s in self.slots:
                g, part = s.param.grad, full[s.offset:s.offset + s.numel]
                if g is None:
                    part.zero_()
                    continue
                part.copy_(g.reshape(-1))
                s.param.grad = None  # stage 2: the full-size gradient lives only in the bucket
            full[self.numel:].zero_()
        return self._reduce_into_master(full)

    def _reduce_into_master(self, full: torch.Tensor) -> Handle:
        """Average `full` over ranks into master_grad, in collectives of at most bucket_numel."""
        comm, world = self.comm, self.comm.world_size
        owned = {t.data_ptr() for t in (self.grad_flat, self.grad_acc) if t is not None}
        release = (lambda: None) if full.data_ptr() in owned else self.ledger.transient("buffers", full)
        handles: list[Handle] = []
        if not self.policy.shard_optimizer:  # all-reduce; master covers the whole buffer
            step = max(ALIGN, self.bucket_numel)
            for lo in range(0, self.padded_numel, step):
                part = full[lo:lo + step]
                handles.append(comm.all_reduce_(part, self._where(lo, step), average=True, async_op=True,
                                                unit=self.index))
            return _join(handles, lambda: (self._deliver(self.master_grad, full), release()))
        out = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=self.device)
        chunk = max(ALIGN, -(-self.bucket_numel // (world * ALIGN)) * ALIGN)
        rows = full.view(world, self.shard_numel)
        for lo in range(0, self.shard_numel, chunk):
            hi = min(lo + chunk, self.shard_numel)
            # One bucket = the same column range of every rank's shard, so a reduce-scatter of it
            # hands each rank its own piece.
            handle = comm.reduce_scatter(out[lo:hi], rows[:, lo:hi], self._where(lo, chunk),
                                         average=True, async_op=True, unit=self.index)
            if self.host is not None:  # offload: each bucket leaves for the host once reduced
                handle = _join([handle], lambda lo=lo, hi=hi: self._accept_grad(out, lo, hi))
            handles.append(handle)
        if self.host is not None:
            return _join(handles, release)
        return _join(handles, lambda: (self._accept_grad(out, 0, self.shard_numel), release()))

    def _accept_grad(self, out: torch.Tensor, lo: int, hi: int) -> None:
        """Add elements [lo, hi) of this rank's reduced gradient shard to the master gradient,
        wherever each element's master lives (host part first, then the device part)."""
        k = self.host_numel
        if lo < k:  # adds: the host gradient is zeroed after every step (one reduction: written)
            self.host.take_grad(out[lo:min(hi, k)], lo)
        if hi > k:
            start = max(lo, k)
            self._deliver(self.master_grad[start - k:hi - k], out[start:hi])

    def _deliver(self, dest: torch.Tensor, reduced: torch.Tensor) -> None:
        """See [Note: one reduction, one meaning]: write where reduced once per step, add where
        reduced every micro-step; nothing to do where the collective ran in `dest` itself."""
        if dest.data_ptr() == reduced.data_ptr() and dest.dtype == reduced.dtype:
            return
        if self.policy.shard_gradients:
            dest.add_(reduced)
        else:
            dest.copy_(reduced)

    def _where(self, lo: int, step: int) -> str:
        return f"unit '{self.name}'" if step >= self.padded_numel else \
            f"unit '{self.name}' bucket {lo // step}"

    def end_backward(self) -> None:
        if not self._launched and self.grad_acc is not None:  # a micro-step before the boundary
            self.grad_acc.add_(self.grad_flat)
            self.grad_flat.zero_()
        self._ready.clear()
        self._launched = False

    @property
    def launched(self) -> bool:
        return self._launched

    # ---- step ---------------------------------------------------------------------------------
    def grad_sq_norm(self) -> torch.Tensor:
        total = self.master_grad.double().pow(2).sum() if self.master_grad is not None else \
            torch.zeros((), dtype=torch.float64, device=self.device)
        return total + self.host.grad_sq_norm() if self.host is not None else total

    def publish_weights(self) -> None:
        """After the optimizer step: new master -> compute weights -> every rank (asynchronous).

        [Note: weights in flight] While GATHERING, the parts of `flat` other ranks own are being
        gathered and must not be read: the engine waits before `step()` returns (user code may
        read any parameter then), so the gathers overlap only the rest of the step. With
        zero_optimization.async_weight_publish it waits later instead: in the unit's forward
        pre-hook, before any state_dict, and before the next backward or step.
        """
        k = self.host_numel  # the host part was written back by the offload executor
        if self.shard is not None:  # stage 3: the shard is the weights' home
            if self.master.data_ptr() != self.shard[k:].data_ptr():
                self.shard[k:].copy_(self.master.detach())
            if self.state is WeightState.SHARDED:
                return
            self.state = WeightState.SHARDED  # persistent / still-gathered units gather anew
            self.gather()
            return
        a, b = self.opt_range
        if self.master.data_ptr() != self.flat[a + k:b].data_ptr():
            self.flat[a + k:b].copy_(self.master.detach())
        if self.policy.shard_optimizer:
            self.state = WeightState.GATHERING
            self._gather_handle = self.comm.all_gather(self.flat, self.name, async_op=True,
                                                       unit=self.index)

    def gather(self) -> None:
        """Start gathering the full weights into `flat` (stage 3, or a re-publish); idempotent."""
        if self.state is not WeightState.SHARDED:
            return
        nbytes = self.padded_numel * self.flat.element_size()
        if self.flat.untyped_storage().nbytes() != nbytes:
            self.flat.untyped_storage().resize_(nbytes)
            self._release_bytes = self.ledger.transient("weights", self.flat)
        lo = self.comm.rank * self.shard_numel
        own = self.flat[lo:lo + self.shard_numel]  # this rank's slot: the all-gather's input
        self.state = WeightState.GATHERING
        if self.shard.device == own.device or not uses_streams(own):
            # A device shard; or offload_param on a CPU-only machine, where this is the same
            # host -> "device" copy between two buffers, synchronous.
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
        if self.state is WeightState.GATHERING:
            handle, self._gather_handle = self._gather_handle, None
            handle.wait()
            if self._fetch_stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self._fetch_stream)
                self._fetch_stream = None
            self.state = WeightState.GATHERED
            if self.shard is not None:
                self._point_params_at(self.flat)

    def _point_params_at(self, flat: torch.Tensor | None) -> None:
        for s in self.slots:
            if flat is None:
                s.param.data = self._placeholder.expand(s.shape)
            else:
                s.param.data = flat[s.offset:s.offset + s.numel].view(s.shape)

    def release(self) -> None:
        """Drop the full weights, keeping the shard (stage 3, non-persistent units only)."""
        if self.persistent or self.state is WeightState.SHARDED:
            return
        self.wait_weights()
        self._free_flat()

    def absorb_edits(self) -> None:
        """`flat` was edited (and made equal on every rank): carry the edit into shard and master.

        Master elements whose 16-bit rounding did not change keep their fp32 value, so gathering
        to read (or to edit a few weights) does not lose the master's precision elsewhere.
        """
        if self.shard is not None:
            lo = self.comm.rank * self.shard_numel
            self.shard.copy_(self.flat[lo:lo + self.shard_numel])
        if self.master is None:
            return
        a, b = self.opt_range
        k = self.host_numel
        if self.host is not None:
            self.host.absorb(self.flat[a:a + k])
        new = self.flat[a + k:b]
        homes = {new.data_ptr()} | ({self.shard[k:].data_ptr()} if self.shard is not None else set())
        if self.master.data_ptr() in homes:
            return  # fp32: the master is these weights
        with torch.no_grad():
            changed = new != self.master.to(new.dtype)
            self.master[changed] = new[changed].float()

    def retire(self) -> None:
        """Give up the parameters to another unit (zero.Init's construction units): free our
        buffers and forget the parameters without touching their `.data`."""
        for s in self.slots:
            if unit_of(s.param) is self:
                del _UNIT_OF[id(s.param)]
        self.flat.untyped_storage().resize_(0)
        self.shard = None
        self.state = WeightState.SHARDED
        if self._release_bytes is not None:
            self._release_bytes()
            self._release_bytes = None

    def _free_flat(self) -> None:
        self._point_params_at(None)
        self.flat.untyped_storage().resize_(0)
        self.state = WeightState.SHARDED
        if self._release_bytes is not None:
            self._release_bytes()
            self._release_bytes = None

    def zero_grad(self) -> None:
        self.used = False
        if self.master_grad is not None:
            self.master_grad.zero_()
        if self.host is not None:
            self.host.zero_grad()
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
            (a, b), source, partitioned = self.opt_range, self.master.detach(), self.policy.shard_optimizer
        elif self.shard is not None:
            lo = self.comm.rank * self.shard_numel
            (a, b), source, partitioned = (lo, lo + self.shard_numel), self.shard, True
        else:
            return self.flat.float()
        if self.trainable and self.host is not None:
            full[a:a + self.host_numel].copy_(self.host.master_values())
            a += self.host_numel
        full[a:b].copy_(source)
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


def _join(handles: list[Handle], after) -> Handle:
    """One handle for several collectives, with a completion step after all of them."""
    describe = handles[0].describe

    def finish() -> None:
        for h in handles:
            h.wait()
        after()
    return Handle(None, finish, describe)
