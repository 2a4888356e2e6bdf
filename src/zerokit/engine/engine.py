"""The Engine: forward, backward, step, accumulation, loss scaling and clipping.

It owns no bytes: units hold the buffers, the ledger counts them, the policy decides what is
partitioned. The whole training step reads top to bottom in `backward` and `step`.
"""
from __future__ import annotations

import logging
import functools
import math
import time
import weakref
from collections import deque
from typing import Any

import torch
import torch.nn as nn

from zerokit.config.schema import ZeroKitConfig
from zerokit.comm.collectives import Comm, Handle
from zerokit.units.unit import Unit
from zerokit.units.lease import ReadLease
from zerokit.engine.checkpoint_state import CheckpointMethods
from zerokit.engine.failed_step import FailedSteps
from zerokit.engine.attachment import Attachment, weakly
from zerokit.engine.deepspeed_api import DeepSpeedEngineAPI
from zerokit.engine.byte_plan import max_pending_reduce_numel
from zerokit.parts.executors import HostExecutor
from zerokit.parts.speculation import SpeculationCounts, settle
from zerokit.states import EngineFailedError, TrainingState, move
from zerokit.engine.health import (LossWatch, check_replicas_agree, describe_position, handle_nonfinite,
                                   reduce_step_scalars)
from zerokit.engine.precision import LossScaleAtMinimumError, LossScaler, cast_inputs_half
from zerokit.engine.offload_states import OffloadStatesAPI
from zerokit.engine.preemption import Preemption
from zerokit.engine.monitor import Monitor
from zerokit.engine.throughput import ThroughputTimer
from zerokit.engine.wall_clock import WallClockTimers
from zerokit.policy import PartitionPolicy
from zerokit.gather import schedule_for
from zerokit.tiers import Ledger
from zerokit.tier_names import TierName

log = logging.getLogger("zerokit")


class Engine(DeepSpeedEngineAPI, OffloadStatesAPI, CheckpointMethods, FailedSteps, nn.Module):
    def __init__(self, module: nn.Module, config: ZeroKitConfig, comm: Comm, policy: PartitionPolicy,
                 units: list[Unit], optimizer: torch.optim.Optimizer, lr_scheduler: Any,
                 ledger: Ledger, batch: tuple[int, int, int], executors: list):
        """executors: the optimizer executors (parts/executors.py), host ones first."""
        super().__init__()
        self.module = module
        self.config = config
        self.comm = comm
        self.policy = policy
        self.units = units
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.ledger = ledger
        # DeepSpeed's getters read these: train_batch_size(), train_micro_batch_size_per_gpu(),
        # gradient_accumulation_steps() (see the DeepSpeed API section at the end).
        self._train_batch_size, self._micro_batch_size, self._gradient_accumulation_steps = batch
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary
        self._last_grad_norm: float | None = None  # get_global_grad_norm: the last step's
        self._abandoned_step: int | None = None  # this rank's optimizer raised at that step
        self._failure = ""  # why the engine is FAILED (see _fail)
        spp = config.steps_per_print  # DeepSpeed's timer logs its speed line this often
        self.tput_timer = ThroughputTimer(batch[0], steps_per_output=spp if spp != math.inf else None)
        self.timers = WallClockTimers()  # DeepSpeed's engine.timers, for the script's own regions
        self.monitor = Monitor(config.ignored_raw)  # DeepSpeed's engine.monitor (engine/monitor.py)
        self.loss_scaler = LossScaler.from_config(config)
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.global_samples = 0
        # What the last step() did, as DeepSpeed reports it: was_step_applied() (False after a
        # step() that was not a boundary, or whose update was skipped) and overflow (the last
        # boundary's update was skipped: fp16 overflow or a non-finite gradient, any loss scale).
        self._step_applied = False
        self._last_step_skipped = False
        self.training_dataloader = None  # set by initialize(training_data=...)
        # deepspeed.initialize sets it: the few answers whose shape differs between zerokit's API
        # and DeepSpeed's follow DeepSpeed's (load_checkpoint's; see deepspeed_api.py).
        self.deepspeed_api = False
        # An asynchronous save reads the state in place until it releases this (units/lease.py);
        # the units share it, so an edit through GatheredParameters waits for it too.
        self.save_lease = ReadLease()
        for u in units:
            u.lease = self.save_lease
        # See [Note: engine lifetime] (engine/attachment.py): hooks, threads, and their release.
        self._attachment = Attachment(module, units, comm, sharded=policy.shard_weights)
        self._attachment.executors = executors  # their workers end when the engine is released
        self._release_when_dropped = weakref.finalize(self, self._attachment.release, "dropped")
        self._release_when_dropped.atexit = False  # at exit, peers may be gone: no collective waits
        self.executors = executors
        self.nvme_tier = None  # the NVMe tier, when something lives there (set by initialize)
        self.rss_watch = None  # engine/host_budget.py RssWatch (set by initialize)
        # What the engine is doing, for hooks and failure reports ([Note: state machines], states.py)
        self.training_state = TrainingState.IDLE
        self._recomputing: nn.Module | None = None  # the outermost module recomputing in backward
        self._reduce_now = False
        # reductions in flight: (handle, bytes, the unit whose offloaded parts step once it
        # lands: with offload_optimizer.step_in_backward, a unit whose last backward is done)
        self._pending: deque[tuple[Handle, int, Unit | None]] = deque()
        # offload_optimizer.step_in_backward as resolved at initialize (engine/assemble.py:
        # "auto", and off where the host cannot hold the restores); see [Note: the speculative
        # step] in parts/speculation.py
        self._steps_in_backward = False
        self._step_units_now = False  # this backward is the boundary's: landed units step
        self._speculate_next = True  # offload_optimizer.speculation: see _gradient_coef
        self.speculation = SpeculationCounts()  # committed / redone / skipped, the redo's time
        self._pending_bytes = 0
        self._timers = {"forward": 0.0, "backward": 0.0, "step": 0.0}  # wall_clock_breakdown
        # Gradients of at most two buckets in flight: enough to overlap, bounded in memory.
        # overlap_comm=false (DeepSpeed's meaning): wait for each reduction as soon as it starts.
        self._max_pending_bytes = 4 * max_pending_reduce_numel(config.zero_optimization)
        self._hooks = self._attachment.hooks
        self._hooks += [p.register_post_accumulate_grad_hook(functools.partial(weakly(self._on_grad), u, i))
                        for u in units if u.trainable for i, s in enumerate(u.slots)
                        for p in [s.param]]
        # Stage 3 gathers around use; below, a schedule that only waits for a publish in flight.
        self.scheduler = schedule_for(units, comm, config.zero_optimization, module, policy)
        self._install_module_hooks()
        comm.position = weakly(self._describe_position)
        self._losses = LossWatch()  # non-finite losses, read at the step ([Note: non-finite steps])
        self._preemption = Preemption.install(self, config.preemption)  # [Note: preemption]

    def _describe_position(self) -> str:
        return describe_position(self)

    def _install_module_hooks(self) -> None:
        """Thin hooks: each asks the gather schedule to have the weights ready."""
        by_module: dict[int, list[Unit]] = {}
        for u in self.units:
            by_module.setdefault(id(u.module), []).append(u)
        self._hooks.append(self.module.register_forward_pre_hook(
            weakly(self._start_iteration), prepend=True))
        for units in by_module.values():
            module = units[0].module
            self._hooks.append(module.register_forward_pre_hook(
                functools.partial(weakly(self._before_forward), units)))
            self._hooks.append(module.register_forward_hook(
                functools.partial(weakly(self._after_forward), units)))
        self._hooks.append(self.module.register_state_dict_pre_hook(weakly(self._before_state_dict)))

    @property
    def offload(self):
        """The host optimizer executor, where part of the optimizer steps on the host (else None):
        for reports, checkpoints and tests; the step itself loops over `executors`."""
        return next((e for e in self.executors if type(e) is HostExecutor), None)

    @property
    def stepped_in_backward(self) -> bool:
        """offload_optimizer.step_in_backward has stepped some part since the last step."""
        return any(e.stepped_in_backward for e in self.kernel_executors)

    @property
    def kernel_executors(self) -> list:
        """The executors running the host kernel on a worker (host memory, and NVMe streamed):
        both may hold a delayed update ([Note: delayed update in checkpoints])."""
        return [e for e in self.executors if isinstance(e, HostExecutor)]

    def _move(self, new: TrainingState) -> None:
        if self.training_state is TrainingState.FAILED:
            raise EngineFailedError(self._failure)
        self.training_state = move(self.training_state, new, "the engine")

    def _start_iteration(self, *_hook_args: Any) -> None:
        self.scheduler.start_iteration()

    def _before_forward(self, units: list[Unit], module: nn.Module, *_hook_args: Any) -> None:
        if self.training_state is TrainingState.BACKWARD:  # a forward inside backward: recompute
            self._move(TrainingState.RECOMPUTE)
            self._recomputing = module
        # A recomputed forward is part of the backward's schedule, not a second forward.
        recompute = self.training_state is TrainingState.RECOMPUTE
        use = self.scheduler.use_in_backward if recompute else self.scheduler.use
        for u in units:
            self.ledger.phase = u.phase_names[recompute]  # see [Note: the memory timeline]
            use(u)

    def _after_forward(self, units: list[Unit], module: nn.Module, _args: Any, output: Any) -> None:
        recompute = self.training_state is TrainingState.RECOMPUTE
        for u in units:
            (self.scheduler.after_recompute if recompute else self.scheduler.after_forward)(u, output)
        if recompute and module is self._recomputing:
            self._move(TrainingState.BACKWARD)
            self._recomputing = None

    def _before_state_dict(self, *_args: Any, **_kwargs: Any) -> None:
        self.scheduler.check_state_dict()
        self.wait_for_weights()

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._require_states_loaded("forward")
        self.tput_timer.start()
        t0 = time.perf_counter()
        if self.config.fp16.auto_cast:
            args = cast_inputs_half(args)
        self._move(TrainingState.FORWARD)
        self.ledger.phase = "forward"
        try:
            out = self.module(*args, **kwargs)
        finally:
            self._move(TrainingState.IDLE)
        self._timers["forward"] += time.perf_counter() - t0
        return out

    # ---- backward -----------------------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:  # the caller counts micro-steps (Accelerate)
            return self._boundary_override
        return (self.micro_steps + 1) % self._gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
                 ) -> torch.Tensor:
        """Backpropagate loss / gradient_accumulation_steps (times the fp16 loss scale) and
        return loss / gradient_accumulation_steps, as DeepSpeed. scale_wrt_gas=False: the caller
        already divided the loss (the HF Trainer does); loss is backpropagated and returned as is."""
        self._require_states_loaded("backward")
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError(f"engine.backward expects a scalar loss tensor (got "
                             f"{type(loss).__name__}{tuple(loss.shape) if torch.is_tensor(loss) else ''})")
        # Stage >= 2 reduces every micro-step (gradients never persist in full); below that,
        # gradients accumulate locally and are reduced once, on the boundary's backward.
        boundary = self.is_gradient_accumulation_boundary()
        self._reduce_now = self.policy.shard_gradients or boundary
        self._step_units_now = self._steps_in_backward and boundary and self._speculate_next
        self._losses.note(loss)
        t0 = time.perf_counter()
        self.wait_for_weights()  # units whose modules forward did not call
        scale = self.loss_scaler.scale / (self._gradient_accumulation_steps if scale_wrt_gas else 1)
        self._move(TrainingState.BACKWARD)
        self.ledger.phase = "backward"
        try:
            (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
            if self._reduce_now:
                for unit in self.units:  # units some of whose parameters got no gradient this step
                    if unit.trainable and not unit.launched:
                        self._launch_reduce(unit)
                self._step_landed(self._drain(0))
        finally:
            self._move(TrainingState.IDLE)
            self._recomputing = None
        for unit in self.units:
            unit.end_backward()
        self.scheduler.end_backward()
        self._timers["backward"] += time.perf_counter() - t0
        # As DeepSpeed: the loss as scaled for accumulation (what a loop logs, summed over the
        # window, is the window's mean), never the fp16 loss scale.
        return loss / self._gradient_accumulation_steps if scale_wrt_gas else loss

    def _on_grad(self, unit: Unit, index: int, param: nn.Parameter) -> None:
        if unit.on_grad_ready(param, index, self._reduce_now):
            self._launch_reduce(unit, done=True)
            self.scheduler.after_backward(unit)

    def _launch_reduce(self, unit: Unit, done: bool = False) -> None:
        """Ranks whose backward took different paths would reduce different units here: each
        reduction carries its unit's index and fails naming both units (see [Note: rank
        agreement] in comm/agreement.py), at the latest when the step settles the checks.
        done: every parameter of the unit got its gradient in this backward (the hook's launch;
        not the end-of-backward one for units some parameter of which got none)."""
        self._track(unit.launch_reduce(), unit, step=done and self._step_units_now)

    def _track(self, handle: Handle, unit: Unit, step: bool = False) -> None:
        nbytes = unit.padded_numel * 4
        self._pending.append((handle, nbytes, unit if step else None))
        self._pending_bytes += nbytes
        self._step_landed(self._drain(self._max_pending_bytes))

    def _drain(self, limit: int) -> list[Unit]:
        """Wait for reductions until at most `limit` bytes are in flight, and take every
        completed one (at world 1, all: its buffer is given back at once); the units among
        them whose offloaded parts step now (step_in_backward)."""
        landed = []
        while self._pending and (self._pending_bytes > limit or self._pending[0][0].ready()):
            handle, nbytes, unit = self._pending.popleft()
            handle.wait()
            self._pending_bytes -= nbytes
            if unit is not None:
                landed.append(unit)
        return landed

    def _step_landed(self, units: list[Unit]) -> None:
        """step_in_backward: each unit's offloaded parts step now, while backward goes on, with
        the coefficient known now (1 / loss scale); the step decides whether that update stands
        (see [Note: the speculative step] in parts/speculation.py, and _settle_speculation)."""
        if units:  # an asynchronous save may still read the state these updates change
            self.save_lease.settle()
        for unit in units:
            for executor in self.kernel_executors:
                executor.offer(unit, 1.0 / self.loss_scaler.scale)

    # ---- step ---------------------------------------------------------------------------------
    def step(self) -> None:
        """Update the weights at the accumulation boundary; otherwise only count the micro-step.

        When it returns, every parameter the user can reach holds the new weights (see
        [Note: weights in flight]), unless zero_optimization.async_weight_publish is set.
        """
        self._require_states_loaded("step")
        if self.training_state is TrainingState.FAILED:
            raise EngineFailedError(self._failure)
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:  # refused inside forward or backward, before anything is counted
            self._move(TrainingState.STEP)
            self.ledger.phase = "step"
        try:
            self.micro_steps += 1
            self._step_applied = False
            self.tput_timer.stop(global_step=boundary, report_speed=self.comm.rank == 0)
            if not boundary:
                return
            t0 = time.perf_counter()
            overflow = self._boundary_step()
        finally:  # idle again, unless the step failed the engine (_abandon_step)
            if self.training_state is TrainingState.STEP:
                self._move(TrainingState.IDLE)
            if boundary:
                self.ledger.phase = "idle"
                self.ledger.end_step()
        if boundary and self.rss_watch is not None:  # the host budget and drift ([Note: budgets])
            self.rss_watch.sample()
        self._timers["step"] += time.perf_counter() - t0
        if self.global_steps % self.config.steps_per_print == 0:
            self._report_progress(overflow)
        self._preemption.after_step(self)  # SIGTERM: save and exit ([Note: preemption])

    def _boundary_step(self) -> bool:
        """Step's work at the accumulation boundary; True if the update was skipped (overflow)."""
        self.save_lease.settle()  # an async save may still be reading the state this step changes
        # Every collective so far agreed across ranks, before the step applies their results
        # (on CUDA the checks still in flight are waited here, where the norm / flags sync anyway).
        self.comm.settle_agreement()
        trainable = [u for u in self.units if u.trainable]
        try:
            overflow = self._update(trainable)
        except BaseException as error:
            self._abandon_step(trainable, error)
            raise
        self._step_applied, self._last_step_skipped = not overflow, overflow
        try:
            self.loss_scaler.update(overflow)  # raises at fp16's min_loss_scale (precision.py)
        except LossScaleAtMinimumError:
            self._clear_grads()
            raise
        self.global_steps += 1
        # DeepSpeed's count: a whole batch per boundary, however the caller drove the micro-steps
        # (Accelerate calls step() only at the boundary it set).
        self.global_samples += self._train_batch_size
        self._clear_grads()  # while the new weights are gathered
        if not self.config.zero_optimization.async_weight_publish:
            self.wait_for_weights()
        self._record_io()
        return overflow

    def _update(self, trainable: list[Unit]) -> bool:
        """Unscale, clip, step and publish; True if the step was skipped for an overflow."""
        for executor in self.executors:  # host gradients landed; a delayed update joined
            executor.before_step()
        coef, overflow = self._gradient_coef(trainable)
        redo = self._settle_speculation(coef, overflow)
        if self._steps_in_backward and not self._step_units_now:
            self.speculation.held_back += 1
        if overflow:  # static or dynamic loss scale alike, as DeepSpeed
            self.skipped_steps += 1
            for executor in self.executors:
                executor.after_skip()
            return True
        t0 = time.perf_counter()
        self._run_optimizer(trainable, coef)
        if redo:
            self.speculation.redo_s += time.perf_counter() - t0
        self._publish(trainable)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return False

    def _gradient_coef(self, trainable: list[Unit]) -> tuple[float, bool]:
        """(factor that unscales and clips the gradients, whether they overflowed)."""
        scale = self.loss_scaler.scale
        coef = 1.0 / scale
        clip = self.config.gradient_clipping
        # One all-reduce: the norm (of the scaled gradients), non-finite losses, SIGTERM.
        scalars = reduce_step_scalars(trainable, self.comm, self.policy.shard_optimizer,
                                      self._losses, self._preemption.requested,
                                      abandoned=self._abandoned_step is not None)
        mine, self._abandoned_step = self._abandoned_step, None
        check_replicas_agree(mine, scalars.abandoned_by, self.comm, self.policy.shard_optimizer)
        self._preemption.agreed = scalars.preempted
        self._step_unused = scalars.unused  # read by _unused_everywhere
        norm = scalars.grad_norm
        self._last_grad_norm = norm / scale  # get_global_grad_norm() after the step reads it
        if not math.isfinite(norm) or scalars.nonfinite_losses:
            if not self.loss_scaler.checks_overflow:  # fp16 overflows are the loss scale's
                self._settle_speculation(coef, overflow=True)  # "stop" raises next: as before it
                handle_nonfinite(self, trainable, scalars)  # reports; raises for "stop"
            return coef, True
        clip_coef = clip / (norm / scale + 1e-6) if clip > 0 else 1.0
        if clip_coef < 1.0:
            coef *= clip_coef
        # 'adaptive': after a clipped step the next speculation would likely be redone: skip it
        self._speculate_next = (clip_coef >= 1.0 or
                                self.config.zero_optimization.offload_optimizer.speculation == "always")
        return coef, False

    def _settle_speculation(self, coef: float, overflow: bool) -> bool:
        """Commit or roll back the update applied in backward; True: it is to be redone
        (parts/speculation.py `settle`)."""
        return settle(self.kernel_executors, coef, overflow, self.speculation)

    def _run_optimizer(self, trainable: list[Unit], coef: float) -> None:
        """Every executor steps its parts of the units some rank used, the host parts in a worker
        while the device parts step (Twin-Flow); see parts/executors.py."""
        unused = set(self._unused_everywhere(trainable))
        try:
            for executor in self.executors:
                executor.launch(coef, unused)
        finally:
            for executor in self.executors:  # a host worker is joined unless its update is delayed
                executor.finish()

    def _publish(self, trainable: list[Unit]) -> None:
        """New master -> compute weights -> every rank, in the order forward will need them."""
        for u in sorted(trainable, key=lambda u: u.module is not self.module):
            u.publish_weights()

    def _report_progress(self, overflow: bool) -> None:
        """DeepSpeed's steps_per_print line (and wall_clock_breakdown timers), on rank 0."""
        if self.comm.rank == 0:
            line = (f"step={self.global_steps} skipped={self.skipped_steps} lr={self.get_lr()} "
                    f"loss_scale={self.loss_scaler.scale:g}{' (overflow)' if overflow else ''}")
            if self._steps_in_backward:
                c = self.speculation
                line += (f" speculative: committed={c.committed} redone={c.redone} "
                         f"skipped={c.skipped} held_back={c.held_back} redo_s={c.redo_s:.3f}")
            if self.config.wall_clock_breakdown:
                n = self.config.steps_per_print
                line += " | ms/step: " + ", ".join(f"{k} {v / n * 1e3:.1f}" for k, v in self._timers.items())
            log.info(line)
        self._timers = dict.fromkeys(self._timers, 0.0)

    def _unused_everywhere(self, units: list[Unit]) -> list[Unit]:
        """Units no rank produced a gradient for since the last step: agreed in the step's one
        all-reduce, with the gradient norm (see health.reduce_step_scalars)."""
        return [u for u in units if u in self._step_unused]

    def wait_for_weights(self) -> None:
        """Finish gathering the weights of the last step (see [Note: weights in flight])."""
        for u in self.units:
            u.wait_weights()

    def zero_grad(self) -> None:
        """Kept for loops written for torch or DeepSpeed; discards nothing.

        Gradients are the engine's: it clears them at the end of every step (an overflowing one
        too). Called anywhere else (between accumulation micro-steps, between backward and step),
        clearing would discard gradients the coming step needs, which DeepSpeed's ZeRO optimizers
        never do either.
        """

    def _clear_grads(self) -> None:
        for u in self.units:
            if u.trainable:
                u.zero_grad()

    def consolidated_fp32_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's fp32 value by name, gathered on every rank (one unit at a time)."""
        self.wait_for_weights()
        out: dict[str, torch.Tensor] = {}
        for u in self.units:
            out.update({k: v.clone() for k, v in u.split(u.full_master()).items()})
        # Tied parameters live once in a unit; the state dict names every alias, as torch's does.
        canonical = {id(p): n for n, p in self.module.named_parameters()}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if name not in out:
                out[name] = out[canonical[id(p)]]
        return out

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> list[str]:
        """The consolidated compute-dtype model as safetensors, one unit in memory at a time."""
        from zerokit.export import save_16bit_model

        return save_16bit_model(self, save_dir, save_filename,
                                exclude_frozen_parameters=exclude_frozen_parameters)

    # ---- introspection ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where this rank computes (cuda:LOCAL_RANK under torchrun): move each batch here."""
        return self.comm.device

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def memory_report(self, peak: bool = False) -> str:
        text = self.ledger.format(f"memory on rank {self.comm.rank} ({'peak' if peak else 'now'})", peak)
        io = self.nvme_io()
        if io:  # ZeRO-Infinity: the last step's NVMe I/O (see nvme_io)
            text += (f"\nnvme I/O, last step: read {io['bytes_read'] / 2**20:.2f} MiB, wrote "
                     f"{io['bytes_written'] / 2**20:.2f} MiB, {io['gb_per_s']:.2f} GB/s over "
                     f"{io['io_s']:.3f} s, threads waited {io['wait_s']:.3f} s on I/O "
                     f"(optimizer stream {io['stream_s']:.3f} s)")
            if "idle_s" in io:  # where the disk waited on compute (see nvme_io)
                text += (f"; disk idle {io['idle_s']:.3f} s of the step's {io['window_s']:.3f} s "
                         f"(no read {io['read_idle_s']:.3f} s, no write {io['write_idle_s']:.3f} s)")
            asked = io.get("sums_read_ahead", 0) + io.get("sums_read_when_asked", 0)
            if asked:  # gradient files summed over micro-steps (see [Note: gradient read-ahead])
                text += (f"; gradient sums read ahead {io['sums_read_ahead']} of {asked} "
                         f"({io['sums_read_when_asked']} read when asked)")
        if self._steps_in_backward:  # offload_optimizer.step_in_backward's speculative steps
            text += "\n" + self.speculation.line()
        return text

    def memory_timeline(self):
        """The last complete step's bytes per tier and kind, each change with its phase
        (tiers/timeline.py MemoryTimeline; `.save(path)`, then `zerokit plot path`)."""
        return self.ledger.last_step_timeline()

    def nvme_io(self) -> dict:
        """The last step's NVMe I/O, {} without NVMe: bytes read and written since the previous
        step's end (weights read for forward and backward, gradients, the optimizer stream, the
        weights written back), GB/s over the I/O's wall time, seconds threads waited on it, the
        optimizer stream's own wall time, and the disk's idle time over the step (`window_s`,
        since the previous step's report): `idle_s` with no request in flight, `read_idle_s`
        with no read, `write_idle_s` with no write (the I/O engine's own clock); with
        accumulation at stages 2-3, how many earlier gradient sums were served read ahead
        (`sums_read_ahead`) and read when asked (`sums_read_when_asked`)."""
        return self.ledger.io(TierName.NVME)

    def _record_io(self) -> None:
        if self.nvme_tier is None:
            return
        report = self.nvme_tier.stats.take()
        sums = self.nvme_tier.read_ahead.take()  # the accumulation's earlier gradient sums
        report["sums_read_ahead"], report["sums_read_when_asked"] = sums["ahead"], sums["now"]
        report["stream_s"] = sum(getattr(e, "stream_s", 0.0) for e in self.kernel_executors)
        self.ledger.record_io(TierName.NVME, report)

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        self.training = mode
        return self

    def destroy(self) -> None:
        """Let go of the model and the process: see [Note: engine lifetime]."""
        self.save_lease.wait()  # its thread reads the state this releases
        self.wait_for_weights()
        self._release_when_dropped.detach()
        self._attachment.release("destroyed")
