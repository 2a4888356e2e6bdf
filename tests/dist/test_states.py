"""Every state machine refuses a move its transition table does not list ([Note: state machines]):
the table itself, and each owner through its own guarded move: a unit's weights, the host and
device optimizer executors, the engine's training state."""
from __future__ import annotations

import pytest
import torch

from harness import run_world
from reference import tiny_gpt

MICRO = 2


def test_every_move_outside_the_table_raises() -> None:
    from zerokit.states import LEGAL, ExecutorState, IllegalTransition, TrainingState, WeightState, move

    for machine in (WeightState, ExecutorState, TrainingState):
        for current in machine:
            for new in machine:
                if new in LEGAL[current]:
                    assert move(current, new, "owner") is new
                    continue
                with pytest.raises(IllegalTransition) as e:
                    move(current, new, "owner")
                assert f"'{current.value}' -> '{new.value}'" in str(e.value) and "owner" in str(e.value)


def test_the_step_shard_and_swap_tables_list_exactly_these_moves() -> None:
    """The moves written out here, independently of states.LEGAL: every other one raises."""
    from zerokit.states import IllegalTransition, ShardResidency, SwapState, TrainingState, move

    legal = {
        (TrainingState.IDLE, TrainingState.STEP), (TrainingState.STEP, TrainingState.IDLE),
        (TrainingState.STEP, TrainingState.FAILED),
        (ShardResidency.EMPTY, ShardResidency.READING), (ShardResidency.READING, ShardResidency.RESIDENT),
        (ShardResidency.READING, ShardResidency.EMPTY), (ShardResidency.RESIDENT, ShardResidency.EMPTY),
        (SwapState.WRITING, SwapState.NVME), (SwapState.NVME, SwapState.PREFETCHING),
        (SwapState.PREFETCHING, SwapState.PREFETCHED), (SwapState.PREFETCHING, SwapState.NVME),
        (SwapState.PREFETCHED, SwapState.NVME)}
    pairs = [(a, b) for m in (ShardResidency, SwapState) for a in m for b in m]
    pairs += [(a, b) for a in TrainingState for b in TrainingState if TrainingState.STEP in (a, b)]
    for current, new in pairs:
        if (current, new) in legal:
            assert move(current, new, "owner") is new
            continue
        with pytest.raises(IllegalTransition, match=f"owner: illegal state change '{current.value}' -> "
                                                    f"'{new.value}'"):
            move(current, new, "owner")


def _engine(stage: int, offload: bool):
    import zerokit

    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "delayed_update": {"enabled": True, "warmup_steps": 0}}
    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(0), config={
        "train_micro_batch_size_per_gpu": MICRO, "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    return engine


def _illegal_weights_move(rank: int, world: int) -> None:
    from zerokit.states import IllegalTransition, WeightState

    engine = _engine(3, offload=False)
    unit = next(u for u in engine.units if u.state is WeightState.SHARDED)
    with pytest.raises(IllegalTransition, match=f"unit '{unit.name}' weights: illegal state change "
                                                f"'sharded' -> 'gathered'"):
        unit._move(WeightState.GATHERED)  # a wait without a gather: nothing was gathered
    assert unit.state is WeightState.SHARDED
    engine.destroy()


def test_a_units_weights_refuse_an_illegal_move() -> None:
    # two ranks: one rank's units are never sharded ([Note: one rank's shard is its weights])
    run_world(_illegal_weights_move, 2)


def test_executors_refuse_an_illegal_move() -> None:
    from zerokit.states import ExecutorState, IllegalTransition
    from zerokit.parts.executors import DeviceExecutor

    engine = _engine(2, offload=True)
    x = torch.randint(0, 256, (MICRO, 16))
    engine.backward(engine(x, x))
    engine.step()  # the delayed host update now runs into the next step
    host = engine.offload
    assert host.state is ExecutorState.RUNNING
    with pytest.raises(IllegalTransition, match="host optimizer executor: illegal state change "
                                                "'running' -> 'running'"):
        host.launch(1.0, set())  # a second update over the one in flight
    host.drop_pending()
    assert host.state is ExecutorState.IDLE
    host.restore_pending()
    with pytest.raises(IllegalTransition, match="'write-back pending' -> 'write-back pending'"):
        host.restore_pending()
    device = next(e for e in engine.executors if isinstance(e, DeviceExecutor))
    with pytest.raises(IllegalTransition, match="device optimizer executor: illegal state change "
                                                "'idle' -> 'idle'"):
        device._move(ExecutorState.IDLE)  # finishing an update that was never launched
    engine.destroy()


def test_the_engine_refuses_backward_inside_forward() -> None:
    from zerokit.states import IllegalTransition, TrainingState

    engine = _engine(1, offload=False)
    x = torch.randint(0, 256, (MICRO, 16))
    loss = engine(x, x)
    hook = engine.module.register_forward_hook(lambda *_: engine.backward(loss))
    with pytest.raises(IllegalTransition, match="the engine: illegal state change 'forward' -> 'backward'"):
        engine(x, x)
    hook.remove()
    assert engine.training_state is TrainingState.IDLE  # the failed forward left the state clean
    with pytest.raises(IllegalTransition, match="'idle' -> 'recompute'"):
        engine._move(TrainingState.RECOMPUTE)  # recomputation happens only inside backward
    engine.destroy()


def test_the_step_is_a_training_state_that_failure_reports_name() -> None:
    """Engine.step moves idle -> step -> idle; the rank's position (what a collective failure
    reports) says the state; a step asked for inside forward is refused by the table."""
    from zerokit.states import IllegalTransition, TrainingState

    engine = _engine(3, offload=False)
    seen = []
    engine.optimizer.register_step_pre_hook(
        lambda *_: seen.append((engine.training_state, engine.comm.position())))
    x = torch.randint(0, 256, (MICRO, 16))
    engine.backward(engine(x, x))
    assert engine.training_state is TrainingState.IDLE
    engine.step()
    assert len(seen) == 1 and seen[0][0] is TrainingState.STEP, seen
    assert seen[0][1].startswith("global step 0, step (micro-step 1)"), seen
    assert engine.training_state is TrainingState.IDLE
    assert engine.comm.position().startswith("global step 1, idle (micro-step 1)")
    hook = engine.module.register_forward_hook(lambda *_: engine.step())
    with pytest.raises(IllegalTransition, match="the engine: illegal state change 'forward' -> 'step'"):
        engine(x, x)
    hook.remove()
    assert engine.training_state is TrainingState.IDLE and len(seen) == 1
    assert (engine.micro_steps, engine.global_steps) == (1, 1)  # the refused step counted nothing
    engine.destroy()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_hooks_tell_recomputation_from_forward(use_reentrant) -> None:
    """A block called through torch.utils.checkpoint (as Hugging Face models do) runs its forward
    twice: in forward, and again inside backward, which the engine's hooks see as RECOMPUTE."""
    from torch.utils.checkpoint import checkpoint

    from zerokit.states import TrainingState

    engine = _engine(2, offload=False)
    model = engine.module
    block = model.transformer.h[0]
    seen = []
    block.register_forward_pre_hook(lambda *_: seen.append(engine.training_state))
    t = model.transformer

    def forward(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = t.drop(t.wte(idx) + t.wpe(torch.arange(idx.shape[1])))
        for b in t.h:
            x = checkpoint(b, x, use_reentrant=use_reentrant)
        logits = model.lm_head(t.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
    model.forward = forward
    x = torch.randint(0, 256, (MICRO, 16))
    engine.backward(engine(x, x))
    assert seen == [TrainingState.FORWARD, TrainingState.RECOMPUTE], seen
    assert engine.training_state is TrainingState.IDLE
    engine.step()
    engine.destroy()


@pytest.mark.parametrize("failure", ["collective", "nvme", "other"])
def test_a_step_that_leaves_inconsistent_state_fails_the_engine(failure, tmp_path) -> None:
    """A step failing in a collective (the ranks may not agree) or on the NVMe tier (swap files
    partly written) makes the engine FAILED: forward, backward and step then raise, saying why
    and what to do; any other failure leaves an engine that trains on (engine._abandon_step)."""
    import zerokit
    from zerokit.comm.collectives import CollectiveError
    from zerokit.states import TrainingState
    from zerokit.io.aio import AioError

    engine = _engine(2, offload=False)
    errors = {"collective": CollectiveError("all_gather of unit 'x' timed out"),
              "nvme": AioError(28, "writing", "/swap/x.swp", offset=0),
              "other": RuntimeError("a bug in a user's optimizer hook")}
    run = engine._run_optimizer

    def failing(*args, **kwargs):
        engine._run_optimizer = run
        raise errors[failure]
    engine._run_optimizer = failing
    x = torch.randint(0, 256, (MICRO, 16))
    engine.backward(engine(x, x))
    with pytest.raises(type(errors[failure])):
        engine.step()
    if failure == "other":
        engine.backward(engine(x, x))
        engine.step()
        assert engine.global_steps == 1
    else:
        assert engine.training_state is TrainingState.FAILED
        hint = "restart the job" if failure == "collective" else "load the last checkpoint"
        for attempt in (lambda: engine(x, x), lambda: engine.step(),
                        lambda: engine.backward(torch.ones((), requires_grad=True)),
                        lambda: engine.save_checkpoint(str(tmp_path))):  # never a torn checkpoint
            with pytest.raises(zerokit.EngineFailedError, match=hint) as e:
                attempt()
            assert str(errors[failure]) in str(e.value)
        assert not list(tmp_path.iterdir())
    engine.destroy()
