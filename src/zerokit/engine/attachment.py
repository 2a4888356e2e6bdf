"""What an engine attaches to the user's model and to the process, and letting go of it once.

[Note: engine lifetime]
An engine hooks the user's model (gradient, forward and state-dict hooks), points the model's
parameters into its units' buffers, and may run threads (the host optimizer's worker, the
Comm's heartbeat). The user's model outlives the engine, so:
- hooks on the model reach the engine only through weak references (`weakly`): a model the user
  keeps does not keep a dropped engine, its units and their buffers alive;
- nothing of the engine is in a module-level registry holding strong references, and the engine's
  objects form no reference cycles, so dropping the engine frees its buffers at once, without
  waiting for a gc pass;
- an `Attachment` (which does not reference the engine) undoes what the engine did to the model
  and the process exactly once: at `engine.destroy()`, or when a dropped engine is collected
  (a `weakref.finalize`).
After that, at stages 0-2 the model is a plain torch model again, holding the trained weights
(views of the units' weight buffers, which the parameters keep alive). At stage 3 its weights were
partitioned across ranks into buffers that are gone: its parameters are placeholders and calling
the model raises, saying so, rather than computing with them.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch.nn as nn


def weakly(method: Callable) -> Callable:
    """A hook calling a bound method of the engine without keeping the engine alive; a no-op once
    the engine is gone (its attachment removes the hook then anyway)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)
    return call


def _detached(how: str, *_hook_args: Any) -> None:
    raise RuntimeError(
        f"this model's weights were partitioned by a zerokit engine that was {how} (ZeRO stage 3): "
        f"its parameters are placeholders now. Keep the engine to train or run it, or save the weights "
        f"first (engine.save_16bit_model(dir) or engine.consolidated_fp32_state_dict()) and load them "
        f"into a new model")


class Attachment:
    def __init__(self, module: nn.Module, units: list, comm: Any, sharded: bool):
        self.module = module
        self.units = units
        self.comm = comm
        self.sharded = sharded  # stage 3: the model cannot work without the engine
        self.hooks: list = []  # RemovableHandles of the hooks on the model
        self.executors: list = []  # optimizer executors, whose worker threads may be running
        self.watches: list = []  # engine/host_budget.py RssWatch: its sampling thread stops
        self.tiers: list = []  # nvme tiers (weight shard files): closed, files removed, at release
        self.released = False

    def release(self, how: str) -> None:
        """Remove the hooks, end the threads, leave the model usable (or saying why it is not)."""
        if self.released:
            return
        self.released = True
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()
        for executor in self.executors:
            executor.close()
        for watch in self.watches:
            watch.close()
        for u in self.units:
            # A weight publish in flight: every rank issued its collective, so finishing it here
            # needs no peer to act; its buffers must not be freed under the backend.
            u.wait_weights()
            for s in u.slots:
                # below stage 2 views of the unit's gradient buffer, above autograd's own
                # tensors: either way the model must not keep them
                s.param.grad = None
            if self.sharded:
                u._point_params_at(None)  # keep no gathered buffer alive through the model
        for tier in self.tiers:  # after the units' writes in flight landed
            tier.close()
        self.tiers = []
        if self.sharded:
            self.module.register_forward_pre_hook(functools.partial(_detached, how), prepend=True)
        self.comm.close()
        self.module, self.units, self.executors, self.watches = None, [], [], []
