"""ZeRO-3 helpers users know from DeepSpeed: GatheredParameters (and Init, below)."""
from __future__ import annotations

import weakref
from typing import Iterable

import torch
import torch.nn as nn

from zerokit.core.unit import Unit, WeightState, unit_of


class GatheredParameters:
    """Gather the full weights of `params` for reading or editing, on every rank.

        with zerokit.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
            if rank == 0:
                model.lm_head.weight.zero_()

    Every rank must enter with the same parameters (it is a collective). With `modifier_rank`,
    that rank's edits are broadcast on exit and written into the shards and the fp32 master;
    without it, edits are discarded. Units that were already gathered stay so.
    """

    def __init__(self, params: "nn.Parameter | Iterable[nn.Parameter]", modifier_rank: int | None = None,
                 fwd_module: nn.Module | None = None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.units: list[Unit] = []
        for p in params:
            unit = unit_of(p)
            if unit is not None and unit not in self.units:
                self.units.append(unit)
        self.units.sort(key=lambda u: u.index)  # the same order on every rank
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._gathered_here: list[Unit] = []

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled:
            return self
        for u in self.units:
            if u.state is WeightState.SHARDED:
                u.gather()
                self._gathered_here.append(u)
            u.wait_weights()
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        try:
            if self.modifier_rank is not None and exc[0] is None:
                from zerokit.checkpoint import settle_checkpoint
                settle_checkpoint()  # the edits reach the shards an async save may be writing
                for u in self.units:
                    u.comm.broadcast_(u.flat, src=self.modifier_rank, where=f"unit '{u.name}' (edit)")
                    u.absorb_edits()
        finally:
            for u in self._gathered_here:
                u.release()
            self._gathered_here = []


# Construction units made under Init, by module: initialize() adopts their values, then retires
# them. Weak keys, and units that do not reference their module (module=None): a model built
# under Init and dropped without initialize() takes its shards with it.
_CONSTRUCTED: "weakref.WeakKeyDictionary[nn.Module, Unit]" = weakref.WeakKeyDictionary()


class Init:
    """Build a model partitioned module by module, so it never exists whole on one rank.

        with zerokit.zero.Init(config=ds_config):
            model = MyModel()        # each module's weights are sharded as its __init__ returns
        engine, *_ = zerokit.initialize(model=model, config=ds_config)

    Per-rank memory while building is about total / N plus the module being built. Each
    module's initial values are rank 0's (broadcast before sharding), so every rank builds the
    same model. `module.apply(fn)` inside the context gathers each module's weights around fn
    (with rank 0's edits kept), which is how most models run their custom initialisation; code
    that writes to parameters of other, already built modules must use GatheredParameters.
    """

    def __init__(self, config=None, enabled: bool = True, **_ignored_deepspeed_kwargs):
        self.enabled = enabled
        self.config = config
        self._patched: list[tuple[type, object]] = []
        self._saved_apply = None
        self._saved_init_subclass = None

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        from zerokit.config import load_config
        from zerokit.core.collectives import Comm
        from zerokit.policy import PartitionPolicy
        from zerokit.tiers import Ledger

        timeout = load_config(self.config).comm_timeout_s if self.config is not None else 1800.0
        self.comm = Comm.from_environment(timeout)
        self.policy = PartitionPolicy.for_stage(3)
        self.ledger = Ledger()
        for cls in _all_module_classes():
            self._wrap_init(cls)
        self._saved_init_subclass = nn.Module.__dict__.get("__init_subclass__")
        init = self

        def init_subclass(cls, **kwargs):  # classes defined inside the context are wrapped too
            super(nn.Module, cls).__init_subclass__(**kwargs)
            init._wrap_init(cls)
        nn.Module.__init_subclass__ = classmethod(init_subclass)
        self._saved_apply = nn.Module.apply

        def apply(module: nn.Module, fn):
            for child in module.children():
                child.apply(fn)
            with GatheredParameters(list(module.parameters(recurse=False)), modifier_rank=0):
                fn(module)
            return module
        nn.Module.apply = apply
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        for cls, original in reversed(self._patched):
            cls.__init__ = original
        self._patched = []
        nn.Module.apply = self._saved_apply
        if self._saved_init_subclass is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._saved_init_subclass

    def _wrap_init(self, cls: type) -> None:
        if "__init__" not in cls.__dict__ or getattr(cls.__init__, "_zerokit_wrapped", False):
            return
        original = cls.__init__
        init = self

        def __init__(module, *args, **kwargs):
            original(module, *args, **kwargs)
            # Partition once the most-derived __init__ is done (a subclass may still edit weights).
            owner = next(c for c in type(module).__mro__ if "__init__" in c.__dict__)
            if owner is cls:
                init._partition(module)
        __init__._zerokit_wrapped = True
        __init__.__wrapped__ = original
        cls.__init__ = __init__
        self._patched.append((cls, original))

    def _partition(self, module: nn.Module) -> None:
        params = [(name, p) for name, p in module.named_parameters(recurse=False) if unit_of(p) is None]
        if not params:
            return
        unit = Unit(f"{type(module).__name__}@{id(module):x}", params, module=None, trainable=False,
                    group_index=-1, comm=self.comm, policy=self.policy,
                    compute_dtype=params[0][1].dtype, reduce_dtype=params[0][1].dtype,
                    bucket_numel=1 << 62, ledger=self.ledger)
        _CONSTRUCTED[module] = unit


def adopt_constructed(model: nn.Module, params: list[nn.Parameter]) -> list[Unit]:
    """Gather the construction units holding `params` so their values can be read (initialize)."""
    units = []
    for p in params:
        u = unit_of(p)
        if u is not None and u not in units and u.group_index == -1:
            u.gather()
            u.wait_weights()
            units.append(u)
    return units


def retire_constructed(model: nn.Module) -> None:
    """Free every construction unit of this model's modules (adopted or orphaned by tying)."""
    for m in model.modules():
        unit = _CONSTRUCTED.pop(m, None)
        if unit is not None:
            unit.retire()


def _all_module_classes() -> list[type]:
    seen, stack = [], [nn.Module]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                stack.append(sub)
    return seen
