"""Optimizer executors: each steps the optimizer parts of one tier ([Note: optimizer parts]).

Per step, `Engine.step` calls on every executor, host executors first so that they overlap:
    before_step()     gradients still crossing to the executor's tier land; with the delayed
                      update, the previous step's host update is joined and its weights written
    launch(coef, ..)  start this step's update of the parts of units some rank used; coef =
                      clip / loss scale (torch: multiplied into the gradient; host kernel: fused
                      into its grad_scale, no separate pass)
    finish()          the update's weights are ready to publish, unless it is delayed (the host
                      executor's worker then runs into the next step's forward and backward:
                      ZeRO-Offload's one-step delayed update)
    after_skip()      an overflowing step launched nothing: still publish what before_step wrote
With offload_optimizer.step_in_backward the kernel executors start earlier: backward `offer`s
each unit once its gradient is reduced, and the worker steps its parts while backward goes on
(a `PartFeed` open until before_step, or until something reads a part's state) under a
`SpeculativeStep` (parts/speculation.py): before_step joins that worker (SPECULATED), the engine
`settle`s it (commit: the weights are written back; rollback: the parts are as before, and
launch steps them again, or nothing runs for a skipped step); launch then steps the parts not
stepped (units this rank's backward did not reach but another rank's did, and redone ones).
`DeviceExecutor`: torch's optimizer over the device parts. `HostExecutor`: the native kernel over
the host parts, in a worker thread. The streaming NVMe executor (read i+1, step i, write i-1;
parts/nvme_executor.py) is a HostExecutor whose `_run` streams the nvme parts from their files,
so the worker, the delayed update and its write-back are one mechanism for both. Each has an
`ExecutorState` ([Note: state machines]).
"""
from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any, Callable

import torch

from zerokit.parts.kernel_part import STATE_NAMES, KernelOperands, KernelPart
from zerokit.parts.speculation import HostRestore, SpeculativeStep
from zerokit.states import ExecutorState, move
from zerokit.optim.recipe import state_bytes
from zerokit.optim import HostAdagrad, HostAdam, HostLion, Lion
from zerokit.optim import host as K
from zerokit.policy import PlacementPolicy
from zerokit.tier_names import TierName

SUPPORTED = ("Adam, AdamW, Adagrad and Lion (config types), torch.optim.Adam/AdamW/Adagrad and "
             "zerokit.optim.Lion instances")


def kernel_for(optimizer: torch.optim.Optimizer, kernels: Any = K
               ) -> tuple[str, Callable[[KernelOperands, dict, float], None]]:
    """(state family, step function) for the optimizer whose hyper-parameters the host follows.
    `kernels`: the module whose adam_step / adagrad_step / lion_step run it (optim/host.py, or
    optim/device_kernels.py for a bf16 device part: the same arguments, the same bits)."""
    kind = type(optimizer)
    # Subclasses count (DeepSpeed's names in zerokit.compat.deepspeed.ops are subclasses).
    if issubclass(kind, (torch.optim.Adam, torch.optim.AdamW, HostAdam)):
        def adam(s: KernelOperands, g: dict, coef: float) -> None:
            adamw = g["adamw_mode"] if issubclass(kind, HostAdam) else \
                issubclass(kind, torch.optim.AdamW) or bool(g.get("decoupled_weight_decay", False))
            b1, b2 = g["betas"]
            kernels.adam_step(s.master, s.grad, s.state["exp_avg"], s.state["exp_avg_sq"],
                              lr=g["lr"], beta1=b1, beta2=b2, eps=g["eps"],
                              weight_decay=g["weight_decay"], step=s.step, adamw=adamw,
                              bias_correction=g.get("bias_correction", True),
                              grad_scale=-coef if g.get("maximize") else coef, out16=s.out16,
                              **s.rounding)
        return "adam", adam
    if issubclass(kind, (torch.optim.Adagrad, HostAdagrad)):
        def adagrad(s: KernelOperands, g: dict, coef: float) -> None:
            kernels.adagrad_step(s.master, s.grad, s.state["sum"], lr=g["lr"], eps=g["eps"],
                                 weight_decay=g["weight_decay"], step=s.step,
                                 lr_decay=g["lr_decay"],
                                 grad_scale=-coef if g.get("maximize") else coef, out16=s.out16,
                                 **s.rounding)
        return "adagrad", adagrad
    if issubclass(kind, (HostLion, Lion)):
        def lion(s: KernelOperands, g: dict, coef: float) -> None:
            b1, b2 = g["betas"]
            kernels.lion_step(s.master, s.grad, s.state["exp_avg"], lr=g["lr"], beta1=b1,
                              beta2=b2, weight_decay=g["weight_decay"],
                              grad_scale=-coef if g.get("maximize") else coef, out16=s.out16,
                              step=s.step, **s.rounding)
        return "lion", lion
    raise TypeError(f"zero_optimization.offload_optimizer: optimizer {kind.__module__}.{kind.__name__} "
                    f"has no host kernel; offload supports {SUPPORTED}")


def bind_parts(optimizer: torch.optim.Optimizer, parts) -> tuple[str, Callable]:
    """The host kernel for `optimizer` (kernel_for), each part's param group and its initial
    state; fails, naming the optimizer, where no kernel exists (host and NVMe executors alike)."""
    family, step_fn = kernel_for(optimizer)
    if any(g.get("amsgrad") for g in optimizer.param_groups):
        raise ValueError(f"zero_optimization.offload_optimizer: {type(optimizer).__name__}"
                         f"(amsgrad=True) has no host kernel; set amsgrad=False")
    group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    for part in parts:
        part.group = group_of[id(part.unit.master)]
        fill = optimizer.param_groups[part.group].get("initial_accumulator_value", 0.0)
        part.init_state(family, fill if family == "adagrad" else 0.0)
    return family, step_fn


def _bf16_kernel_or_torch(optimizer: torch.optim.Optimizer, units: list):
    """How the device parts' bf16 masters step: (family, step function) of the host kernel's math
    (optim/device_kernels.py) for the optimizers that have one; None for the others (SGD, Adam
    with amsgrad, ...), which torch's optimizer steps on the bf16 master in bf16, as DeepSpeed's
    device path does. Its state is then bf16 (torch keeps state in the parameter's dtype), so
    fp32 states or stochastic rounding with such an optimizer raise, naming what to change."""
    from zerokit.optim import device_kernels

    why = "amsgrad=True" if any(g.get("amsgrad") for g in optimizer.param_groups) else None
    if why is None:
        try:
            return kernel_for(optimizer, device_kernels)
        except TypeError:
            why = f"{type(optimizer).__name__} (no kernel)"
    parts = [p for u in units if u.master.dtype == torch.bfloat16 for p in u.parts[-1:]]
    if any(p.state_dtype != torch.bfloat16 for p in parts):
        raise NotImplementedError(
            f"bf16.bf16_master_weights_and_grads with {why} on the device: torch's optimizer steps "
            f"the bf16 master and keeps its state in bf16, so bf16.bf16_optimizer_states must be "
            f"true (as DeepSpeed requires without offload); fp32 states with a bf16 master are "
            f"implemented for {SUPPORTED}")
    if any(p.rounding for p in parts):
        raise NotImplementedError(
            f"bf16.stochastic_rounding with {why} on the device: torch's optimizer rounds to "
            f"nearest; stochastic rounding is implemented for {SUPPORTED}")
    return None


class DeviceExecutor:
    """Torch's optimizer over the device parts (`unit.master`, gradient `unit.master_grad`).

    The optimizer reads `master.grad`, which user code may have reset since the last step
    (torch's `optimizer.zero_grad()` sets it to None): it is linked here, for the step only.
    Units no rank produced a gradient for keep None, so torch skips them, as it skips
    parameters without a gradient.

    A bf16 master (bf16.bf16_master_weights_and_grads) is stepped by the host kernel's math where
    the optimizer has a kernel (fp32 math, rounded once), through the torch fallback on the
    device (optim/device_kernels.py; `_step_bf16`), with its state in torch's optimizer state
    under torch's keys (checkpoints and state dicts read it there), in the part's `state_dtype`;
    other optimizers are torch's, in bf16 (`_bf16_kernel_or_torch`).
    """

    def __init__(self, units: list, optimizer: torch.optim.Optimizer, ledger):
        self.units = [u for u in units if u.trainable]
        self.optimizer = optimizer
        self.state = ExecutorState.IDLE
        self.ledger = ledger
        self._bf16_step = None  # (family, step function) where the masters are bf16
        if any(u.master.dtype == torch.bfloat16 for u in self.units):
            self._bf16_step = _bf16_kernel_or_torch(optimizer, self.units)
            self._group = {id(p): gi for gi, g in enumerate(optimizer.param_groups)
                           for p in g["params"]}

    def _move(self, new: ExecutorState) -> None:
        self.state = move(self.state, new, "the device optimizer executor")

    def before_step(self) -> None:
        """Gradients on the device are where the optimizer reads them already."""

    def launch(self, coef: float, skip: set) -> None:
        self._move(ExecutorState.RUNNING)
        if self._bf16_step is not None:
            self._step_bf16(coef, skip)
            return
        for u in self.units:
            if coef != 1.0:
                u.master_grad.mul_(coef)
            u.master.grad = None if u in skip else u.master_grad
        self.optimizer.step()

    def _step_bf16(self, coef: float, skip: set) -> None:
        """The device parts of bf16 masters, each as the host kernel steps a host part: `coef`
        fused as the kernel's grad_scale (the bf16 gradient is not rescaled in place), the state
        created at the first step in the part's state dtype (torch's keys, `step` a float
        tensor as torch keeps it), the part's rounding arguments (engine/bf16_state.py)."""
        family, step_fn = self._bf16_step
        groups = self.optimizer.param_groups
        with torch.no_grad():
            for u in self.units:
                if u in skip:
                    continue
                part = u.parts[-1]
                state = self.optimizer.state[u.master]
                steps = int(state["step"].item()) + 1 if "step" in state else 1
                for key in STATE_NAMES[family]:
                    t = state.get(key)
                    if steps == 1:  # fresh (torch's Adagrad made its sum in the master's dtype)
                        fill = groups[self._group[id(u.master)]].get("initial_accumulator_value", 0.0)
                        t = torch.full_like(u.master, fill if family == "adagrad" else 0.0,
                                            dtype=part.state_dtype)
                    state[key] = t.detach().to(part.state_dtype)
                state["step"] = torch.tensor(float(steps), dtype=torch.float32)
                ops = KernelOperands(u.master.detach(), u.master_grad,
                                     {k: state[k] for k in STATE_NAMES[family]}, None, steps,
                                     part.rounding)
                step_fn(ops, groups[self._group[id(u.master)]], coef)

    def finish(self) -> None:
        for u in self.units:
            u.master.grad = None
        if self.state is ExecutorState.RUNNING:
            self._move(ExecutorState.IDLE)
            # torch creates its state lazily, at the first step: count what it holds now.
            self.ledger.hold_bytes("optimizer", "optimizer_state", TierName.DEVICE, state_bytes(self.optimizer))

    def after_skip(self) -> None:
        """Nothing was launched, nothing is pending."""

    def drop_pending(self) -> None:
        """Nothing runs beyond a step."""

    def close(self) -> None:
        """Nothing to end."""


class PartFeed:
    """The parts a worker steps, in order: all given at launch, or (step_in_backward) put one
    unit at a time while the worker runs, until closed. The worker reports each part done."""

    def __init__(self, parts: list | None = None, open_: bool = False):
        self._parts = list(parts or [])
        self._open = open_
        self._done = 0  # parts the worker has finished (in order)
        self._cv = threading.Condition()

    def put(self, part) -> None:
        with self._cv:
            self._parts.append(part)
            self._cv.notify_all()

    def close(self) -> None:
        """No more parts: the worker ends after the last one (also when it stopped on an error)."""
        with self._cv:
            self._open = False
            self._cv.notify_all()

    @property
    def closed(self) -> bool:
        return not self._open

    def get(self, i: int, wait: bool = True):
        """Part i; None when there is none (closed, or not yet and `wait` is False)."""
        with self._cv:
            while wait and i >= len(self._parts) and self._open:
                self._cv.wait()
            return self._parts[i] if i < len(self._parts) else None

    def finished(self) -> None:
        with self._cv:
            self._done += 1
            self._cv.notify_all()


class WorkerDone:
    """What a stepped part's `wait()` waits for: its worker has stepped every part of its feed.
    Waiting closes the feed first, so reading a part's state between a backward that stepped in
    backward and step() (a checkpoint, a state dict, an edit) ends that worker instead of waiting
    for a step() that this thread would have to call."""

    def __init__(self, feed: PartFeed):
        self._feed: PartFeed | None = feed
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()
        self._feed = None  # the parts hold us (`busy`) and the feed holds them: no cycle

    def wait(self) -> None:
        feed = self._feed
        if feed is not None:
            feed.close()
        self._event.wait()


# Executors whose worker may still run when the interpreter exits (a delayed update in flight).
_LIVE: "weakref.WeakSet[HostExecutor]" = weakref.WeakSet()


@atexit.register
def _join_in_flight() -> None:
    """Interpreter shutdown ends daemon threads by unwinding them from inside the native kernel,
    which aborts the process ('terminate called without an active exception'): join them first."""
    for stepper in list(_LIVE):
        worker, feed = stepper._worker, stepper._feed
        if worker is not None:
            feed.close()
            worker.join()


class HostExecutor:
    """The native kernel over every unit's host part, in a worker thread (see the module note).
    The NVMe executor is this one with `_run` streaming the parts from their files.

    State: IDLE; RUNNING from launch until the worker is joined (in finish, or with the delayed
    update in the next step's before_step); WRITE_BACK_PENDING between the join and the write-back
    of the new weights, and after a checkpoint load that restores a pending write-back.
    """

    tier = TierName.HOST  # the parts it steps

    def __init__(self, units: list, placement: PlacementPolicy):
        _LIVE.add(self)
        self.shards: list[KernelPart] = [p for u in units for p in u.parts if p.tier is self.tier]
        self.placement = placement
        self.launches = 0
        self.state = ExecutorState.IDLE
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stepped: list[KernelPart] = []  # updated by the running / last worker
        self._written: list[KernelPart] = []  # weights written back, not yet published
        self._copied: Any = None  # CUDA event: host -> device weight copies done
        self.optimizer: torch.optim.Optimizer | None = None
        self._feed: PartFeed | None = None  # the running worker's parts
        self._in_backward: set[int] = set()  # ids of parts stepped in this step's backward
        self.speculation: SpeculativeStep | None = None  # this step's update in backward

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """Follow `optimizer`'s param groups; fails here, naming it, if it has no host kernel."""
        self.family, self._step_fn = bind_parts(optimizer, self.shards)
        self.optimizer = optimizer

    @property
    def delaying(self) -> bool:
        return self.placement.delayed and self.launches >= self.placement.warmup_steps

    def _move(self, new: ExecutorState) -> None:
        self.state = move(self.state, new, "the host optimizer executor")

    def before_step(self) -> None:
        for s in self.shards:
            s.settle()
        if self.state is ExecutorState.RUNNING:  # the delayed update, or the speculative one
            self._join()
        if self.state is ExecutorState.WRITE_BACK_PENDING:
            self._write_back()

    @property
    def stepped_in_backward(self) -> bool:
        return bool(self._in_backward)

    def enable_speculation(self) -> None:
        """step_in_backward: each part gets what a rollback restores from (parts/speculation.py)
        and keeps its held gradient's buffer (held until the step decides). After bind."""
        for s in self.shards:
            s.restore = HostRestore(s, s.host_tier)

    def settle(self, commit: bool, skipped: bool) -> None:
        """The step has decided on the update applied in backward ([Note: the speculative step]):
        commit it (its weights are written back now), or roll it back (then `launch` steps the
        parts again with the step's coefficient, or, `skipped`, nothing runs)."""
        if self.speculation is None:
            return
        speculation, self.speculation = self.speculation, None
        if commit:
            speculation.commit()
            self._move(ExecutorState.WRITE_BACK_PENDING)
            self._write_back()
            return
        speculation.roll_back(skipped)
        if self.state is not ExecutorState.IDLE:  # (IDLE: the worker failed, see _join)
            self._move(ExecutorState.IDLE)
        self._stepped, self._in_backward = [], set()

    def launch(self, coef: float, skip: set) -> None:
        if self.speculation is not None:  # Engine._update settles it first
            raise RuntimeError("an update applied in backward was neither committed nor rolled back")
        todo = [s for s in self.shards if s.unit not in skip and id(s) not in self._in_backward]
        if todo or not self._in_backward:  # (step_in_backward: usually all stepped already)
            self._start(PartFeed(todo), coef, todo)
        if self.delaying:
            for s in todo:
                s.swap_grads()
        self.launches += 1

    def offer(self, unit, coef: float) -> None:
        """step_in_backward: `unit`'s gradient has landed; its parts step now, on the worker,
        while backward goes on (started by the step's first offer, joined in before_step), with
        `coef` (1 / loss scale) under the step's `SpeculativeStep`."""
        parts = [s for s in self.shards if s.unit is unit]
        if not parts:
            return
        if self._feed is not None and self._feed.closed:  # a state reader ended the last worker
            self._join()
        if self.speculation is None:
            self.speculation = SpeculativeStep(coef)
        if self._feed is None:
            self._start(PartFeed(open_=True), self.speculation.coef)
        for s in parts:
            if id(s) in self._in_backward:
                raise RuntimeError(
                    f"offload_optimizer.step_in_backward: unit '{unit.name}' finished a second "
                    f"backward before engine.step(); each backward's update is applied as it "
                    f"runs, so call engine.step() after every backward (or turn the key off)")
            s.settle()
            self._in_backward.add(id(s))
            self._enter(s)
            self._feed.put(s)

    def _start(self, feed: PartFeed, coef: float, given: list | None = None) -> None:
        """A worker stepping `feed`'s parts (`given` those it holds already); RUNNING until
        joined."""
        if self._copied is not None:  # the kernel is about to overwrite what is being copied
            self._copied.synchronize()
            self._copied = None
        groups = [dict(g) for g in self.optimizer.param_groups]  # a snapshot: schedulers move on
        self._worker_done = WorkerDone(feed)
        for s in given or []:
            self._enter(s)

        def run() -> None:
            try:
                self._run(feed, groups, coef)
            except BaseException as e:  # re-raised on the training thread at the join
                self._error = e
            finally:
                feed.close()  # an offer waiting for room returns
                self._worker_done.set()

        self._feed = feed
        self._move(ExecutorState.RUNNING)
        self._worker = threading.Thread(target=run, name=f"zerokit-{self.tier}-step", daemon=True)
        self._worker.start()

    def _enter(self, s: KernelPart) -> None:
        """`s` is stepped by the running worker: counted, its gradient taken, marked busy."""
        s.begin_step(self._worker_done)
        self._stepped.append(s)

    def _run(self, feed: PartFeed, groups: list[dict], coef: float) -> None:
        """The update itself, on the worker thread: the kernel over each part in memory."""
        i = 0
        while (s := feed.get(i)) is not None:
            self._before_part(s)
            self._step_fn(s.operands(), groups[s.group], coef)
            feed.finished()
            i += 1

    def _before_part(self, s: KernelPart) -> None:
        """On the worker, before `s` is stepped: a speculative update keeps what restores it."""
        if self.speculation is not None and id(s) in self._in_backward:
            self.speculation.before(s)

    def finish(self) -> None:
        """Join the host update and write its weights back, unless it is delayed to the next step."""
        if self.state is ExecutorState.RUNNING and not (self.placement.delayed and
                                                        self.launches > self.placement.warmup_steps):
            self._join()
            self._write_back()
        self._written = []  # the engine publishes every trainable unit next
        self._in_backward = set()

    def after_skip(self) -> None:
        """A skipped (overflow) step still publishes the delayed weights that before_step wrote."""
        for s in self._written:
            s.unit.publish_weights()
        self._written = []
        self._in_backward = set()

    def _join(self) -> None:
        """RUNNING -> WRITE_BACK_PENDING (SPECULATED for an update applied in backward); a failed
        update is forgotten (IDLE) and re-raised."""
        self._feed.close()  # step_in_backward: backward offers nothing more
        self._worker.join()
        self._worker, self._feed = None, None
        if self._error is not None:
            error, self._error = self._error, None
            self._move(ExecutorState.IDLE)
            self._stepped = []
            if isinstance(error, OSError):  # an I/O failure names its file: raise it as it is
                raise error
            raise RuntimeError(f"the {self.tier} optimizer step failed") from error
        self._move(ExecutorState.SPECULATED if self.speculation is not None
                   else ExecutorState.WRITE_BACK_PENDING)

    def _write_back(self) -> None:
        for s in self._stepped:
            s.write_weights()
        if any(s.pin for s in self._stepped):
            self._copied = torch.cuda.Event()
            self._copied.record()
        self._written, self._stepped = self._stepped, []
        self._move(ExecutorState.IDLE)

    # ---- checkpoints (engine/checkpoint_state.py) ---------------------------------------------------
    @property
    def pending_write_back(self) -> bool:
        """A delayed host update has finished or runs, and its weights are not yet written back."""
        return (self.state not in (ExecutorState.IDLE, ExecutorState.SPECULATED)
                and bool(self._stepped))

    def drop_pending(self) -> None:
        """Before a load: finish this engine's own delayed update and forget its write-back, so it
        neither runs on under the loaded state nor overwrites the loaded weights."""
        if self.state is ExecutorState.RUNNING:
            self._join()
        if self.speculation is not None:  # an update applied in backward: forgotten
            self.settle(commit=False, skipped=False)
        if self.state is ExecutorState.WRITE_BACK_PENDING:
            self._move(ExecutorState.IDLE)
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        self._stepped, self._written, self._in_backward = [], [], set()

    def restore_pending(self) -> None:
        """After a load of a checkpoint saved with an update pending: that update is done (its
        result is the loaded master); the next step writes it back, as the saving run would."""
        self._move(ExecutorState.WRITE_BACK_PENDING)
        self._stepped = list(self.shards)

    def close(self) -> None:
        """The engine is released (see [Note: engine lifetime]): let an update in flight finish,
        so its thread ends, and forget it; nothing is written back, the weights stay as they are."""
        if self._worker is not None:
            self._feed.close()
            self._worker.join()
            self._worker, self._error, self._feed = None, None, None
        self.speculation = None
        if self.state is not ExecutorState.IDLE:
            self._move(ExecutorState.IDLE)
        if self._copied is not None:  # host -> device weight copies still read host buffers
            self._copied.synchronize()
            self._copied = None
        self._stepped, self._written, self._in_backward = [], [], set()
        _LIVE.discard(self)
