"""ZeRO-3 helpers users know from DeepSpeed: GatheredParameters (and Init, below)."""
from __future__ import annotations

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
                for u in self.units:
                    u.comm.broadcast_(u.flat, src=self.modifier_rank, where=f"unit '{u.name}' (edit)")
                    u.absorb_edits()
        finally:
            for u in self._gathered_here:
                u.release()
            self._gathered_here = []
