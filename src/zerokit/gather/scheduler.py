"""The stage-3 scheduler: gather a unit before use, prefetch ahead, release after use.

It records the order units are used in one iteration (forwards then backward, as hooks report
them) and, from the next iteration on, gathers ahead in that order within
`stage3_prefetch_bucket_size` elements, never holding more than `stage3_max_live_parameters`
gathered. When the order changes (data-dependent control flow) prefetching stops for that
iteration, which stays correct, and the new order is recorded.

With offload_param device 'nvme' the prefetch has a first level: beyond the units it gathers, it
starts reading the next units' shards from NVMe into their host buffers (tiers/nvme_shard.py), at
most `offload_param.buffer_count` shards in host memory at once, each at most `buffer_size`
elements (a larger one is read when gathered). Each rank reads only its own shard; the gather
then all-gathers them, so the read bandwidth grows with the ranks.

Ranks that take different paths gather different units: every gather carries its unit's index,
so they fail naming both units instead of pairing collectives wrongly (see [Note: rank
agreement] in comm/agreement.py); a use needs no collective of its own for that.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from zerokit.config.schema import ZeroConfig
from zerokit.comm.collectives import Comm
from zerokit.states import WeightState
from zerokit.units.unit import Unit


class Stage3Scheduler:
    def __init__(self, units: list[Unit], comm: Comm, cfg: ZeroConfig, root: torch.nn.Module):
        self.units = units
        self.comm = comm
        self.root = root
        self.prefetch_numel = cfg.stage3_prefetch_bucket_size
        self.max_live_numel = cfg.stage3_max_live_parameters
        self.max_reuse_distance = cfg.stage3_max_reuse_distance
        self.reshard_after_forward = cfg.reshard_after_forward
        self.nvme_buffers = cfg.offload_param.buffer_count  # shards read ahead at most
        self.nvme_buffer_numel = cfg.offload_param.buffer_size
        for u in units:
            u.persistent = u.weights_are_shard or u.numel <= cfg.stage3_param_persistence_threshold
        self.trace: list[Unit] = []      # uses of the last recorded iteration
        self._recording: list[Unit] = []
        self._pos = 0
        self._following = False          # the current iteration matches `trace` so far
        self._in_backward: set[Unit] = set()  # used by this backward, gradients not all produced
        # read by tests and reports; nvme_*: shards read ahead from NVMe, most in host memory at once
        self.stats = {"uses": 0, "prefetched": 0, "recorded": 0, "nvme_read_ahead": 0,
                      "nvme_buffers_peak": 0}

    # ---- events (called by the engine's hooks) -------------------------------------------------
    def start_iteration(self) -> None:
        """The root module's forward begins; an iteration without backward (eval) ends here."""
        if self._recording:
            self._finish_iteration()
        self._following = bool(self.trace)

    def use(self, unit: Unit) -> None:
        """Before a unit's forward or backward: its weights must be gathered when this returns."""
        if self._following and (self._pos >= len(self.trace) or self.trace[self._pos] is not unit):
            self._following = False  # the order changed: stay correct, stop predicting, re-record
        self._recording.append(unit)
        self._pos += 1
        self.stats["uses"] += 1
        unit.gather()
        if self._following:
            self._prefetch()
        unit.wait_weights()

    def use_in_backward(self, unit: Unit) -> None:
        """Before a unit's backward, or before its forward is recomputed inside backward
        (activation checkpointing): one use per backward of the unit. A recomputation and the
        gradient hook of the same backward share it, so the order recorded and the gathers are
        those of a run without checkpointing, and the prefetch follows the backward order."""
        if unit in self._in_backward:
            unit.gather()  # gathered since its first use in this backward: nothing to start
            unit.wait_weights()
            return
        self._in_backward.add(unit)
        self.use(unit)

    def after_recompute(self, unit: Unit, output: Any) -> Any:
        """A recomputed forward returned: its backward runs next, so the unit stays gathered
        until after_backward (releasing it here would gather it a second time)."""
        return output

    def after_forward(self, unit: Unit, output: Any) -> Any:
        """Arrange the pre-backward gather, and release now unless the unit is used again soon."""
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
            for t in tensors:
                t.register_hook(self._pre_backward_hook(unit))
        if unit.module is not self.root and self.reshard_after_forward and not self._reused_soon(unit):
            unit.release()
        return output

    def after_backward(self, unit: Unit) -> None:
        """All of the unit's gradients were produced (and handed to the reduction)."""
        self._in_backward.discard(unit)
        unit.release()

    def end_backward(self) -> None:
        self._in_backward.clear()
        for u in self.units:
            u.release()
        self._finish_iteration()

    def position(self) -> str:
        """Where this iteration is in its order of uses, for failure reports (see
        engine/health.py::describe_position): ranks that diverged show different positions."""
        last = f", last unit '{self._recording[-1].name}'" if self._recording else ""
        return (f"stage-3 use {self._pos} of this iteration{last} (the recorded order has "
                f"{len(self.trace)} uses)")

    def check_state_dict(self) -> None:
        raise RuntimeError(
            "model.state_dict() at ZeRO stage 3 would gather every weight on every rank; use "
            "engine.consolidated_fp32_state_dict(), engine.save_16bit_model(dir) or "
            "zerokit.zero.GatheredParameters(params) instead")

    # ---- internals ------------------------------------------------------------------------------
    def _pre_backward_hook(self, unit: Unit):
        def hook(grad: torch.Tensor) -> None:
            if unit.state is not WeightState.GATHERED or unit not in self._in_backward:
                self.use_in_backward(unit)
        return hook

    def _finish_iteration(self) -> None:
        if self._recording != self.trace:
            self.trace = self._recording
            self.stats["recorded"] += 1
        self._recording = []
        self._pos = 0
        self._following = False

    def _live_numel(self) -> int:
        return sum(u.padded_numel for u in self.units
                   if u.state is not WeightState.SHARDED and not u.persistent)

    def _prefetch(self) -> None:
        self._read_ahead()  # first: the reads from NVMe run while the gathers below wait on theirs
        budget = self.prefetch_numel
        live = self._live_numel()
        for u in self.trace[self._pos:]:
            if u.state is not WeightState.SHARDED:
                continue
            if u.padded_numel > budget or live + u.padded_numel > self.max_live_numel:
                break
            u.gather()
            self.stats["prefetched"] += 1
            budget -= u.padded_numel
            live += u.padded_numel

    def _read_ahead(self) -> None:
        """NVMe -> host for the next shards in the trace, within offload_param.buffer_count."""
        on_nvme = [u for u in self.units if u.nvme_shard is not None]
        if not on_nvme:
            return
        buffers = sum(u.nvme_shard.in_host_memory for u in on_nvme)
        for u in self.trace[self._pos:]:
            if buffers >= self.nvme_buffers:
                break
            if (u.nvme_shard is None or u.state is not WeightState.SHARDED
                    or u.nvme_shard.in_host_memory or u.shard_numel > self.nvme_buffer_numel):
                continue
            u.fetch()
            buffers += 1
            self.stats["nvme_read_ahead"] += 1
        self.stats["nvme_buffers_peak"] = max(self.stats["nvme_buffers_peak"], buffers)

    def _reused_soon(self, unit: Unit) -> bool:
        """Is the unit used again within max_reuse_distance elements of other units' use?"""
        if not self._following:
            return False
        distance, largest = 0, 0
        for u in self.trace[self._pos:]:
            if u is unit:
                # Kept only if each use before the reuse still fits beside it: those gathers are
                # unconditional, so a kept unit would otherwise push the live elements past the
                # budget (a tiled layer's tiles, each kept for backward, all gathered at once).
                return self._live_numel() + largest <= self.max_live_numel
            distance += u.padded_numel
            if distance > self.max_reuse_distance:
                return False
            if not u.persistent:
                largest = max(largest, u.padded_numel)
        return False
