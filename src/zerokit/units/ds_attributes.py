"""DeepSpeed's per-parameter ZeRO-3 attributes (`ds_id`, `ds_status`, `ds_numel`, `ds_shape`,
`ds_tensor`), as read-only views of the parameter's unit.

[Note: ds_* views] DeepSpeed attaches ~30 mutable attributes to every parameter at stage 3; code
written for it (the HF Trainer's parameter count, PEFT, users' scripts) reads a few of them. Here
each stage-3 parameter's class becomes `ZeroParameter`, an nn.Parameter subclass whose `ds_*`
are properties computed from the unit that holds it (see [Note: unit layout] in unit.py), so
they can never disagree with the unit: there is nothing to keep in sync and nothing to assign.
The class is set once, by `attach_ds_views`, which initialize() calls at stage 3.
"""
from __future__ import annotations

import itertools
import weakref
from enum import Enum

import torch
import torch.nn as nn

from zerokit.units.unit import ParamSlot, Unit, WeightState
from zerokit.units.registry import unit_of


class ZeroParamStatus(Enum):
    """DeepSpeed's names for a parameter's weight state (runtime.zero.partition_parameters)."""

    AVAILABLE = 1      # gathered: `.data` holds the full weights
    NOT_AVAILABLE = 2  # sharded: only this rank's shard exists
    INFLIGHT = 3       # a gather is in flight


_STATUS = {WeightState.GATHERED: ZeroParamStatus.AVAILABLE,
           WeightState.SHARDED: ZeroParamStatus.NOT_AVAILABLE,
           WeightState.GATHERING: ZeroParamStatus.INFLIGHT}

# id(param) -> (weak reference, ds_id): the position in the model's parameter order.
_DS_ID: "dict[int, tuple[weakref.ref, int]]" = {}


class ZeroParameter(nn.Parameter):
    """An nn.Parameter partitioned by a stage-3 unit; `ds_*` read the unit (read-only)."""

    def _slot(self) -> tuple[Unit, ParamSlot]:
        unit = unit_of(self)
        if unit is None:
            raise AttributeError("this parameter is no longer held by a zerokit unit")
        return unit, next(s for s in unit.slots if s.param is self)

    @property
    def ds_id(self) -> int:
        entry = _DS_ID.get(id(self))
        if entry is None or entry[0]() is not self:
            raise AttributeError("ds_id: this parameter was not laid out by zerokit.initialize")
        return entry[1]

    @property
    def ds_status(self) -> ZeroParamStatus:
        return _STATUS[self._slot()[0].state]

    @property
    def ds_numel(self) -> int:
        return self._slot()[1].numel

    @property
    def ds_shape(self) -> torch.Size:
        return self._slot()[1].shape

    @property
    def ds_tensor(self) -> torch.Tensor:
        """This rank's part of the parameter: the elements of its range that lie in this rank's
        shard of the unit (1-D, possibly empty). A view: writing to it edits the shard; with
        offload_param nvme a copy read from the shard's file (writing to it edits nothing)."""
        unit, slot = self._slot()
        lo = unit.shard_range[0]
        a = min(max(slot.offset - lo, 0), unit.shard_numel)
        b = min(max(slot.offset + slot.numel - lo, 0), unit.shard_numel)
        return unit.shard[a:b] if unit.nvme_shard is None else unit.shard_values()[a:b]


_constructed_ids = itertools.count()


def attach_construction_views(params: list[nn.Parameter]) -> None:
    """zero.Init: the ds_* views from the moment a module is partitioned, as DeepSpeed's
    parameters have them before initialize (ds_status NOT_AVAILABLE, and AVAILABLE inside
    GatheredParameters). ds_id counts parameters in construction order, as DeepSpeed's Init
    does; initialize renumbers them in the model's order."""
    for p in params:
        if type(p) is nn.Parameter:
            p.__class__ = ZeroParameter
        _DS_ID[id(p)] = (weakref.ref(p), next(_constructed_ids))


def attach_ds_views(model: nn.Module, units: list[Unit]) -> None:
    """Give every parameter of stage-3 `units` the ds_* views (called once by initialize)."""
    ids = {id(p): i for i, p in enumerate(model.parameters())}
    for u in units:
        for s in u.slots:
            p = s.param
            if type(p) is nn.Parameter:
                p.__class__ = ZeroParameter
            _DS_ID[id(p)] = (weakref.ref(p), ids.get(id(p), -1))
