"""Offloaded optimizer state in checkpoints (offload_optimizer: ZeRO-Offload, Twin-Flow).

With offload, elements [a, a + k) of a unit's optimizer range [a, b) keep their fp32 master and
optimizer state on the host (a HostPart in `unit.parts`) and [a + k, b) stay in the DevicePart:
`unit.master` and torch's optimizer state ([Note: optimizer parts] in core/parts.py). A
checkpoint stores the whole range under the names it has without
offload (`{unit}/master`, `{unit}/optim.{key}`), host part first, written as consecutive parts
(never concatenated in memory). So the files, the resharding and consolidation do not depend on
where the state lived: a checkpoint saved with offload loads without it and the other way round,
at any ratio and world size.

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
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from zerokit.checkpoint.storage import Parts

if TYPE_CHECKING:
    from zerokit.engine.engine import Engine

log = logging.getLogger("zerokit")

IN_USE = "weights_in_use"


# ---- save ---------------------------------------------------------------------------------------
def wait_for_host_updates(engine: "Engine") -> None:
    """A host update in flight (the delayed update's) finishes before its state is read."""
    for u in engine.units:
        for part in u.parts:
            part.wait()


def master_parts(u) -> Parts:
    """The unit's fp32 master over its whole optimizer range: host part, then device part."""
    return [part.master_values() for part in u.parts]


def host_parts(u) -> list:
    return [part for part in u.parts if part.tier == "host"]


def state_keys(u, state: dict) -> list[str]:
    """Optimizer state tensors shaped like the master, as torch's optimizer holds them."""
    keys = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == u.master.shape)
    for host in host_parts(u):
        if host.steps > 0 and keys != sorted(host.state):
            raise RuntimeError(f"unit {u.name}: the host optimizer state has {sorted(host.state)} but "
                               f"the device part's has {keys}; cannot save one optimizer state for the unit")
    return keys


def state_parts(u, state: dict, key: str) -> Parts:
    """One state tensor over the optimizer range: torch's for the device part, the host part's."""
    return [state[key] if part.tier == "device" else part.state[key] for part in u.parts]


def pending_write_back(engine: "Engine") -> bool:
    """A delayed host update has finished or runs, and its weights are not yet written back."""
    return engine.offload is not None and engine.offload.pending_write_back


def offload_record(engine: "Engine") -> dict[str, Any] | None:
    """What common.pt keeps of the host stepper: step counts, launches, a pending write-back."""
    stepper = engine.offload
    if stepper is None:
        return None
    return {"host_steps": {u.name: p.steps for u in engine.units for p in host_parts(u)},
            "launches": stepper.launches, "pending_write_back": pending_write_back(engine)}


def cut(parts: Parts, lo: int, hi: int) -> Parts:
    """Elements [lo, hi) of the 1-D tensor the parts make, as views of the parts."""
    out, start = [], 0
    for p in parts:
        a, b = max(lo, start), min(hi, start + p.numel())
        if a < b:
            out.append(p[a - start:b - start])
        start += p.numel()
    return out or [parts[0][:0]]


# ---- load ---------------------------------------------------------------------------------------
def drop_own_pending_update(engine: "Engine") -> None:
    """Before a load: the loading engine's own delayed update must neither run on under the loaded
    state nor write its weights back over the loaded ones at the next step."""
    if engine.offload is not None:
        engine.offload.drop_pending()


def load_master(saved, u, names: set[str]) -> None:
    """Master of the unit's optimizer range from the checkpoint; the host part's compute weights
    follow it exactly as a host step's write-back does (out16 = master rounded)."""
    for part in u.parts:
        saved.fill(u, "values", part.lo, part.hi, part.master.data, names)
    for host in host_parts(u):
        if host.out16 is not None:
            host.out16.copy_(host.master)
        host.write_weights()
        if host.pin:
            torch.cuda.current_stream().synchronize()


def load_host_state(saved, u, host, keys: list[str], names: set[str], scalars: dict,
                    record: dict | None, source: str) -> None:
    """A host part's optimizer state and step count (see [Note: host step counts])."""
    if not keys:  # saved before any step: a fresh optimizer's state
        for t in host.state.values():
            t.zero_()
        host.steps = 0
        return
    if sorted(host.state) != sorted(keys):
        raise ValueError(f"unit {u.name}: the checkpoint's optimizer state is {sorted(keys)}, this engine's "
                         f"host optimizer keeps {sorted(host.state)}; load with the same optimizer type "
                         f"or pass load_optimizer_states=False")
    for key in keys:
        saved.fill(u, f"optim.{key}", host.lo, host.hi, host.state[key], names, zero_rest=True)
    if record is not None and source in record["host_steps"]:
        host.steps = int(record["host_steps"][source])
    else:  # saved without offload: torch's count of the same updates
        step = scalars.get("step", 0)
        host.steps = int(step.item() if torch.is_tensor(step) else step)


def restore_pipeline(engine: "Engine", saved, names: set[str], record: dict | None, counters: dict) -> None:
    """The host stepper's position; with the delayed update, a pending write-back and the weights
    in use (see [Note: delayed update in checkpoints])."""
    stepper = engine.offload
    if stepper is None:
        return
    stepper.launches = (record["launches"] if record is not None
                        else counters["global_steps"] - counters["skipped_steps"])
    pending = record is not None and record["pending_write_back"]
    if not pending:
        return
    if not stepper.placement.delayed:
        log.info("the checkpoint has a delayed host update pending; this engine has no delayed update, "
                 "so it continues from the master (the newest weights)")
        return
    rank = engine.comm.rank
    for u in engine.units:
        if u.host_numel == 0:
            continue
        lo = rank * u.shard_numel
        u.wait_weights()  # the load's own gather of the master must not land over these
        if u.shard is not None:
            saved.fill(u, IN_USE, lo, lo + u.shard_numel, u.shard, names)
        else:
            saved.fill(u, IN_USE, 0, u.padded_numel, u.flat, names)
        u.publish_weights()
        u.wait_weights()
    stepper.restore_pending()
