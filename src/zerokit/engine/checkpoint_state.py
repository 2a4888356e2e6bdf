"""The engine's side of [Note: checkpoint interface]: its state as named pieces, and loading into it.

Pieces come from the units' optimizer parts ([Note: optimizer parts] in parts/__init__.py): a unit's
optimizer range [a, b) is its parts in order (with offload the host part [a, a + k), then the
device part [a + k, b)), so the saved `{unit}/master` and `{unit}/optim.{key}` are the parts'
tensors one after the other, under the names they have without offload. The files, resharding
and consolidation therefore do not depend on where the state lived: a checkpoint saved with
offload loads without it and the other way round, at any ratio and world size.

[Note: host step counts] The host kernel computes Adam's bias correction from the integer count
of updates, `1 - pow(beta, step)` in double, on both its native and fallback paths ([Note: bias
correction] in csrc/kernels/dispatch.h); nothing is multiplied step by step. So storing the count
(`HostPart.steps`, in common.pt beside torch's per-unit `step`) and restoring it reproduces every
later correction bit for bit. A load into an offloaded engine from a checkpoint saved without
offload takes the count from torch's `step`.

[Note: delayed update in checkpoints] With `delayed_update`, after the warm-up step t's host
update runs while step t+1's forward and backward use the weights before it; step t+1 then writes
update t's weights back. A save waits for the update in flight (never a torn master) but does not
write it back (that would change the run that saves). What is pending then is not in the master:
the weights in use (the compute weights, one update behind the master) are saved as well, as
`{unit}/weights_in_use`, and common.pt says `pending_write_back`. A load into an engine with the
delayed update restores that pipeline exactly: master = update t's result, compute weights = the
weights in use, and a write-back of the master due at the next step. So resuming equals never
stopping, bit for bit. A load into an engine without the delayed update (offload or not) takes
the master, the newest weights, and the weights in use are not read: that engine's math has no
stale weights to continue with.

[Note: nvme parts in checkpoints] An nvme part's master and optimizer state are files (the nvme
tier's `FileRange`s, io/file_range.py, the same class the checkpoint interface names, passed as
they are): they are saved as file-range segments, copied file to file, and loaded into as
file-range targets, never whole in host memory. Its step count is kept as a host part's. Pieces
and names are the same as for the other tiers, so checkpoints move freely between device, cpu and
nvme placements.
"""
from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any

import torch

from zerokit.checkpoint.interface import (FileRange, Fill, HostRecord, LoadPiece, ParamRecord, SavedOptimizer, SavePiece,
                                          SaveState, UnitRecord, segment_numel)
from zerokit.checkpoint.metadata import IN_USE
from zerokit.states import EngineFailedError, TrainingState, WeightState
from zerokit.tier_names import TierName
from zerokit.tiers.host_release import release_free_host_memory

if TYPE_CHECKING:
    from zerokit.units.unit import Unit
    from zerokit.engine.engine import Engine

log = logging.getLogger("zerokit")

COUNTERS = ("global_steps", "micro_steps", "skipped_steps", "global_samples")


def unit_record(u: "Unit") -> UnitRecord:
    # One dtype per unit's master: every part of a unit has the placement's (engine/bf16_state.py).
    master = next((p.master.dtype for p in u.parts), torch.float32)
    return UnitRecord(u.name, u.numel, u.padded_numel, u.shard_numel, u.trainable, u.group_index,
                      u.compute_dtype, tuple(ParamRecord(s.fqn, tuple(s.shape), s.offset, s.numel)
                                             for s in u.slots), master)


# ---- save ---------------------------------------------------------------------------------------
def state_to_save(engine: "Engine") -> SaveState:
    """This rank's saved range of every unit ([Note: checkpoint layout]) as views of the live state."""
    for u in engine.units:  # a host update in flight (the delayed update's) finishes first
        for part in u.parts:
            part.wait()
    if any(e.speculation is not None for e in engine.kernel_executors):
        raise RuntimeError("save_checkpoint between backward and step() with "
                           "zero_optimization.offload_optimizer.step_in_backward: the update "
                           "applied in backward is not decided yet; call engine.step() first")
    host = engine.offload or next(iter(engine.kernel_executors), None)
    # [Note: delayed update in checkpoints]
    in_use = any(e.pending_write_back for e in engine.kernel_executors)
    pieces: list[SavePiece] = []
    optim_keys: dict[str, list[str]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for u in engine.units:
        lo, hi = u.shard_range
        weights = _shard_piece(u) if u.shard is not None else u.flat[lo:hi]
        if not u.trainable:
            pieces.append(SavePiece(f"{u.name}/weights", (weights,)))
            continue
        a = u.opt_range[0]
        pieces.append(SavePiece(f"{u.name}/master", cut([p.master if p.tier is TierName.NVME else
                                                          p.master_values() for p in u.parts],
                                                         lo - a, hi - a)))
        state = engine.optimizer.state.get(u.master, {})
        keys = optim_keys[u.name] = state_keys(u, state)
        for k in keys:
            parts = [state[k] if p.tier is TierName.DEVICE else p.state[k] for p in u.parts]
            pieces.append(SavePiece(f"{u.name}/optim.{k}", cut(parts, lo - a, hi - a)))
        scalars[u.name] = copy.deepcopy({k: v for k, v in state.items() if k not in keys})
        if in_use and _host_parts(u):
            pieces.append(SavePiece(f"{u.name}/{IN_USE}", (weights,)))
    record = None
    if host is not None:
        record = HostRecord({u.name: p.steps for u in engine.units for p in _host_parts(u)},
                            host.launches, in_use)
    return SaveState(pieces, optim_keys, scalars, record)


def _host_parts(u: "Unit") -> list:
    """The parts the host kernel steps: in host memory, or streamed from NVMe."""
    return [p for p in u.parts if p.tier is not TierName.DEVICE]


def _shard_piece(u: "Unit"):
    """A stage-3 unit's weight shard as a segment or load target: the host or device tensor, or
    (offload_param nvme) its file range, streamed file to file, its writes in flight landed."""
    if u.nvme_shard is None:
        return u.shard
    u.nvme_shard.settle()
    u.nvme_shard.drop_clean()  # a read-ahead copy would go stale under a load
    return u.nvme_shard.file


def _narrow(t, a: int, b: int):
    if isinstance(t, FileRange):
        return t.narrow(a, b - a)
    return t[a:b]


def state_keys(u: "Unit", state: dict) -> list[str]:
    """The device part's optimizer state tensors shaped like its master (torch's state also holds
    scalars); a host part holds the same keys (`HostPart.state`, named as torch names them)."""
    keys = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == u.master.shape)
    for host in _host_parts(u):
        if host.steps > 0 and keys != sorted(host.state):
            raise RuntimeError(f"unit {u.name}: the host optimizer state has {sorted(host.state)} but "
                               f"the device part's has {keys}; cannot save one optimizer state for the unit")
    return keys


def cut(parts: list[torch.Tensor], lo: int, hi: int) -> tuple[torch.Tensor, ...]:
    """Elements [lo, hi) of the 1-D tensor the parts make, as views of the parts."""
    out, start = [], 0
    for p in parts:
        a, b = max(lo, start), min(hi, start + segment_numel(p))
        if a < b:
            out.append(_narrow(p, a - start, b - start))
        start += segment_numel(p)
    return tuple(out) or (_narrow(parts[0], 0, 0),)


def training_scalars(engine: "Engine") -> dict[str, Any]:
    sched = engine.lr_scheduler
    return {
        "lr_scheduler": sched.state_dict() if sched is not None and hasattr(sched, "state_dict") else None,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "counters": {k: getattr(engine, k) for k in COUNTERS},
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups],
    }


# ---- load ---------------------------------------------------------------------------------------
def restore_state(engine: "Engine", fill: Fill, optimizer: SavedOptimizer | None) -> None:
    """Weights (masters, frozen units' weights), then the optimizer state and the host executor's
    pipeline unless `optimizer` is None; returns with every weight gather finished."""
    engine.wait_for_weights()
    for executor in engine.executors:  # its own delayed update must not land over the loaded state
        executor.drop_pending()
    records = {u.name: unit_record(u) for u in engine.units}
    with torch.no_grad():
        _load_weights(engine, fill, records)
        if optimizer is not None:
            _load_optimizer(engine, fill, records, optimizer)
            _restore_pipeline(engine, fill, records, optimizer)
    engine.wait_for_weights()


def _load_weights(engine: "Engine", fill: Fill, records: dict[str, UnitRecord]) -> None:
    for u in engine.units:
        rec = records[u.name]
        if u.trainable:
            for part in u.parts:
                target = part.master if part.tier is TierName.NVME else part.master.data
                fill(LoadPiece(rec, "values", part.lo, part.hi, target))
            for host in _host_parts(u):  # compute weights follow as a host step's write-back does
                if host.out16 is not None:
                    host.out16.copy_(host.master_values())
                host.write_weights()
                if host.pin:
                    torch.cuda.current_stream().synchronize()
            # master -> compute weights (-> shard) -> every rank; the gathers run while the next
            # units and the optimizer state are read.
            u.publish_weights()
            continue
        if u.shard is not None:  # stage 3: the shard is the home of a frozen unit's weights
            lo, hi = u.shard_range
            fill(LoadPiece(rec, "values", lo, hi, _shard_piece(u)))
            if u.state is not WeightState.SHARDED:
                fill(LoadPiece(rec, "values", 0, u.padded_numel, u.flat))
        else:
            fill(LoadPiece(rec, "values", 0, u.padded_numel, u.flat))


def _load_optimizer(engine: "Engine", fill: Fill, records: dict[str, UnitRecord],
                    saved: SavedOptimizer) -> None:
    opt = engine.optimizer
    if len(saved.param_groups) != len(opt.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(saved.param_groups)} param groups, this one "
                         f"has {len(opt.param_groups)}; pass load_optimizer_states=False to load weights only")
    for group, saved_group in zip(opt.param_groups, saved.param_groups):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    for u in engine.units:
        unit = saved.units.get(u.name)
        if not u.trainable or unit is None:
            continue
        old = opt.state.pop(u.master, {})
        for host in _host_parts(u):
            _load_host_state(fill, records[u.name], u, host, unit)
        if not unit.keys:  # never stepped: no state, as a fresh optimizer
            continue
        device = u.parts[-1]  # torch's optimizer holds the device part's state
        state: dict[str, Any] = {}
        for k, v in unit.scalars.items():
            state[k] = v.to(u.master.device) if torch.is_tensor(v) and v.dim() > 0 else v
        for k in unit.keys:
            # Reuse this optimizer's tensor where it has one: fresh memory costs page faults.
            t = old.get(k)
            dtype = device.state_dtype  # fp32, or bf16 (bf16.bf16_optimizer_states)
            if not (torch.is_tensor(t) and t.shape == u.master.shape and t.dtype == dtype):
                t = torch.empty_like(u.master, dtype=dtype)
            fill(LoadPiece(records[u.name], f"optim.{k}", device.lo, device.hi, t, zero_rest=True))
            state[k] = t
        opt.state[u.master] = state


def _load_host_state(fill: Fill, rec: UnitRecord, u: "Unit", host, unit) -> None:
    """A host part's optimizer state and step count (see [Note: host step counts])."""
    if not unit.keys:  # saved before any step: a fresh optimizer's state
        for t in host.state.values():
            if isinstance(t, FileRange):
                host.nvme.write(t, torch.zeros(t.numel, dtype=t.dtype)).wait()
            else:
                t.zero_()
        host.steps = 0
        return
    if sorted(host.state) != sorted(unit.keys):
        raise ValueError(f"unit {u.name}: the checkpoint's optimizer state is {sorted(unit.keys)}, this engine's "
                         f"host optimizer keeps {sorted(host.state)}; load with the same optimizer type "
                         f"or pass load_optimizer_states=False")
    for key in unit.keys:
        fill(LoadPiece(rec, f"optim.{key}", host.lo, host.hi, host.state[key], zero_rest=True))
    if unit.host_steps is not None:
        host.steps = unit.host_steps
    else:  # saved without offload: torch's count of the same updates
        step = unit.scalars.get("step", 0)
        host.steps = int(step.item() if torch.is_tensor(step) else step)


def _restore_pipeline(engine: "Engine", fill: Fill, records: dict[str, UnitRecord],
                      saved: SavedOptimizer) -> None:
    """The host executor's position; with the delayed update, a pending write-back and the
    weights in use (see [Note: delayed update in checkpoints])."""
    executors = engine.kernel_executors
    if not executors:
        return
    host = executors[0]
    for e in executors:
        e.launches = saved.launches
    if not saved.pending_write_back:
        return
    if not host.placement.delayed:
        log.info("the checkpoint has a delayed host update pending; this engine has no delayed update, "
                 "so it continues from the master (the newest weights)")
        return
    for u in engine.units:
        if not _host_parts(u):
            continue
        lo, hi = u.shard_range
        u.wait_weights()  # the load's own gather of the master must not land over these
        if u.shard is not None:
            fill(LoadPiece(records[u.name], IN_USE, lo, hi, _shard_piece(u)))
        else:
            fill(LoadPiece(records[u.name], IN_USE, 0, u.padded_numel, u.flat))
        u.publish_weights()
        u.wait_weights()
    for e in executors:
        e.restore_pending()


def restore_training_scalars(engine: "Engine", scalars: dict[str, Any], *, optimizer: bool,
                             lr_scheduler: bool) -> None:
    """Counters and the loss scaler; the LR scheduler where asked (and, when the optimizer's
    param groups were not loaded, the learning rates it set in them)."""
    for k in COUNTERS:
        setattr(engine, k, scalars["counters"][k])
    engine.loss_scaler.load_state_dict(scalars["loss_scaler"])
    if lr_scheduler and engine.lr_scheduler is not None and scalars["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(scalars["lr_scheduler"])
        if not optimizer:  # the learning rates live in the optimizer's param groups
            for group, saved in zip(engine.optimizer.param_groups, scalars["param_groups"]):
                group["lr"] = saved["lr"]


class CheckpointMethods:
    """The engine's checkpoint methods: DeepSpeed's save / load calls, and the narrow interface
    the checkpoint package reads ([Note: checkpoint interface]), answered by the functions above.
    A base of Engine, as DeepSpeedEngineAPI is."""

    # ---- checkpoints (zerokit.checkpoint does the work) ----------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """exclude_frozen_parameters is accepted for DeepSpeed's signature (the HF Trainer probes
        it) and ignored: frozen parameters are saved too, so the checkpoint is larger, not wrong.
        Returns True, as DeepSpeed does."""
        from zerokit.checkpoint import save_checkpoint

        self._require_states_loaded("save_checkpoint")
        if self.training_state is TrainingState.FAILED:  # its state may be torn: never save it
            raise EngineFailedError(self._failure)
        save_checkpoint(self, save_dir, tag=tag, client_state=client_state, save_latest=save_latest)
        return True

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, load_rng_states: bool | None = None):
        """(tag directory, client_state), or (None, None) without a `latest`. Under DeepSpeed's
        API (deepspeed_api) what DeepSpeed's returns: see deepspeed_api.deepspeed_load_result.
        load_rng_states: None reads checkpoint.load_rng_states (default false: the process's
        RNG states are left alone, as DeepSpeed leaves them)."""
        from zerokit.checkpoint import load_checkpoint

        self._require_states_loaded("load_checkpoint")
        if load_rng_states is None:
            load_rng_states = self.config.checkpoint.load_rng_states
        micro_steps = self.micro_steps
        path, client = load_checkpoint(self, load_dir, tag=tag, load_module_strict=load_module_strict,
                                       load_optimizer_states=load_optimizer_states,
                                       load_lr_scheduler_states=load_lr_scheduler_states,
                                       load_module_only=load_module_only, load_rng_states=load_rng_states)
        release_free_host_memory("load_checkpoint")  # the files' pieces read on the way
        if self.deepspeed_api and path is not None:
            self.micro_steps = micro_steps  # DeepSpeed's load leaves it (0 in a fresh engine)
            return self.deepspeed_load_result(path, client)
        return path, client

    # ---- what a checkpoint sees: [Note: checkpoint interface] (checkpoint/interface.py) ---------
    def checkpoint_units(self) -> list[UnitRecord]:
        return [unit_record(u) for u in self.units]

    def state_to_save(self) -> SaveState:
        return state_to_save(self)

    def restore_state(self, fill: Fill, optimizer: SavedOptimizer | None) -> None:
        restore_state(self, fill, optimizer)

    def training_scalars(self) -> dict[str, Any]:
        return training_scalars(self)

    def restore_training_scalars(self, scalars: dict[str, Any], *, optimizer: bool, lr_scheduler: bool) -> None:
        restore_training_scalars(self, scalars, optimizer=optimizer, lr_scheduler=lr_scheduler)
