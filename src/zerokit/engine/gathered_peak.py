"""Stage 3's peak of gathered weights, from the scheduler itself (the estimator and the placement
planner read it).

How many units are gathered at once depends on the prefetch budget, the live-parameter cap, the
reuse distance, the persistence threshold and the order units are used in: the rules of
gather/scheduler.py. Rather than a second copy of those rules, the real `Stage3Scheduler` is
driven through two iterations (one recording the order, one prefetching along it) over stand-in
units that only count the elements they hold gathered, in the order the model's forward used
them (memory/activations.py) and its reverse for backward.
"""
from __future__ import annotations

import torch.nn as nn

from zerokit.gather.scheduler import Stage3Scheduler
from zerokit.states import WeightState


class _Tally:
    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def add(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)


class _StandIn:
    """What the scheduler reads and calls on a Unit; gathering only counts elements."""

    nvme_shard = None
    weights_are_shard = False  # such a unit gathers nothing: callers leave it out

    def __init__(self, name: str, module: nn.Module, numel: int, padded: int, tally: _Tally):
        self.name, self.module, self.numel, self.padded_numel = name, module, numel, padded
        self.state = WeightState.SHARDED
        self.persistent = False
        self._tally = tally

    def gather(self) -> None:
        if self.state is WeightState.SHARDED:
            self.state = WeightState.GATHERED
            self._tally.add(self.padded_numel)

    def wait_weights(self) -> None:
        pass

    def release(self, persistent_too: bool = False) -> None:
        if self.state is WeightState.SHARDED or (self.persistent and not persistent_too):
            return
        self.state = WeightState.SHARDED
        self._tally.add(-self.padded_numel)


def gathered_peak_numel(units: list[tuple[str, nn.Module, int, int]], order: list[nn.Module],
                        root: nn.Module, zero_cfg) -> int:
    """Most elements gathered at once. units: (name, module, numel, padded numel) in unit order;
    order: modules in the order the forward ran them (a unit is used when its module runs)."""
    tally = _Tally()
    stand_ins = [_StandIn(name, module, numel, padded, tally) for name, module, numel, padded in units]
    scheduler = Stage3Scheduler(stand_ins, None, zero_cfg, root)
    by_module: dict[int, list[_StandIn]] = {}
    for s in stand_ins:
        by_module.setdefault(id(s.module), []).append(s)
    forward = [s for m in order for s in by_module.get(id(m), [])]
    forward += [s for s in stand_ins if s not in forward]  # a unit whose module the trace missed
    # backward: the root's outputs are the last forward's, so its use comes first, then the rest
    # in reverse order of their last forward use
    backward = [s for s in forward if s.module is root]
    for s in reversed(forward):
        if s not in backward:
            backward.append(s)
    for _ in range(2):  # the first iteration records the order, the second prefetches along it
        scheduler.start_iteration()
        for s in forward:
            scheduler.use(s)
            scheduler.after_forward(s, None)
        for s in backward:
            scheduler.use_in_backward(s)
            scheduler.after_backward(s)
        scheduler.end_backward()
    return tally.peak
