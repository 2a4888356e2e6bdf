"""What user code does around engine.step(), against the one-process torch reference (issue #14).

- zero_grad from wherever a torch or DeepSpeed loop calls it (the optimizer initialize returned,
  with either set_to_none; the model; the engine), before forward, between backward and step and
  after step (so also between accumulation micro-steps): training equals the reference.
- torch.utils.checkpoint inside every block (use_reentrant True and False), stages 0-3.
- an eval() + no_grad forward between training steps at stage 3 changes nothing.
- every parameter read right after step() holds the new weights (stages 0-2).
- an overflow under a static fp16 loss scale skips the step, as a dynamic one does.
- an optimizer that raises once: the engine stays consistent and trains on.

fp32 cases are compared element-wise (rtol 1e-5, atol 1e-6, as test_parity.py); bf16 cases by the
update's norm and direction, with test_scale_parity.py's bounds and reasons.
"""
from __future__ import annotations

import math
import sys

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from harness import run_world
from reference import global_batches, rank_micro_batch, reference_train, tiny_gpt

WORLD, STEPS, MICRO, GAS = 2, 3, 2, 2
SGD = {"lr": 0.1, "momentum": 0.9}  # scale-sensitive: a lost or doubled gradient shows
STAGE3 = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}


def _config(stage: int, dtype: str = "fp32", gas: int = GAS, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "SGD", "params": SGD}, "bf16": {"enabled": dtype == "bf16"},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000,
                                  **(STAGE3 if stage == 3 else {})}, **extra}


def _loop(engine, batches, rank: int, world: int, gas: int, before_forward=None,
          after_backward=None, after_step=None, between_steps=None) -> list[float]:
    """engine_train's loop with the user's calls at each point of it."""
    losses = []
    for i, batch in enumerate(batches):
        step_loss = 0.0
        for micro in range(gas):
            x, y = rank_micro_batch(batch, rank, world, micro, gas)
            if before_forward:
                before_forward()
            loss = engine(x, y)
            engine.backward(loss)
            if after_backward:
                after_backward()
            engine.step()
            if after_step:
                after_step()
            step_loss += loss.item() / gas
        if between_steps:
            between_steps(i)
        t = torch.tensor([step_loss])
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _reference(gas: int = GAS, steps: int = STEPS, skip: tuple[int, ...] = ()):
    batches = [b for i, b in enumerate(global_batches(steps, MICRO * WORLD * gas)) if i not in skip]
    return reference_train(tiny_gpt, lambda ps: torch.optim.SGD(ps, **SGD), batches)


def _assert_fp32_equal(what: str, losses, weights, ref) -> None:
    ref_losses, ref_weights = ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{what} losses: {m}")
    for name, w in ref_weights.items():
        torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what} {name}: {m}")


def _assert_update_close(what: str, weights, ref) -> None:
    """bf16: the update's norm within 0.5% and cosine > 0.999 (see test_scale_parity.py)."""
    start = dict(tiny_gpt().named_parameters())
    got = torch.cat([(weights[k] - start[k].detach()).reshape(-1) for k in sorted(ref[1])])
    want = torch.cat([(ref[1][k] - start[k].detach()).reshape(-1) for k in sorted(ref[1])])
    norm_err = abs(got.norm() - want.norm()).item() / want.norm().item()
    cos = torch.nn.functional.cosine_similarity(got, want, dim=0).item()
    assert norm_err <= 5e-3 and cos >= 0.999, f"{what}: update norm error {norm_err:.3g}, cosine {cos:.6f}"


# ---- zero_grad from user code ------------------------------------------------------------------
CALLERS = ("optimizer.zero_grad()", "optimizer.zero_grad(set_to_none=False)", "model.zero_grad()",
           "engine.zero_grad()")
POINTS = ("before forward", "between backward and step", "after step")
ZERO_GRAD_CASES = [(stage, dtype, caller, point) for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16")
                   for caller in CALLERS for point in POINTS]


def _zero_grad_cases(rank: int, world: int) -> dict:
    import zerokit

    out = {}
    for case in ZERO_GRAD_CASES:
        stage, dtype, caller, point = case
        model = tiny_gpt()
        engine, optimizer, _, _ = zerokit.initialize(model=model, config=_config(stage, dtype))
        call = {CALLERS[0]: lambda: optimizer.zero_grad(),
                CALLERS[1]: lambda: optimizer.zero_grad(set_to_none=False),
                CALLERS[2]: lambda: model.zero_grad(),
                CALLERS[3]: lambda: engine.zero_grad()}[caller]
        points = {"before_forward" if point == POINTS[0] else
                  "after_backward" if point == POINTS[1] else "after_step": call}
        losses = _loop(engine, global_batches(STEPS, MICRO * world * GAS), rank, world, GAS, **points)
        out[case] = (losses, engine.consolidated_fp32_state_dict())
        engine.destroy()
    return out


@pytest.mark.slow
def test_zero_grad_from_user_code_anywhere_keeps_training_equal_to_reference() -> None:
    results = run_world(_zero_grad_cases, WORLD, timeout=600)
    ref = _reference()
    failures = []
    for case in ZERO_GRAD_CASES:
        for rank, result in enumerate(results):
            losses, weights = result[case]
            what = f"stage {case[0]} {case[1]}, {case[2]} {case[3]}, rank {rank}"
            try:
                if case[1] == "fp32":
                    _assert_fp32_equal(what, losses, weights, ref)
                else:
                    _assert_update_close(what, weights, ref)
            except AssertionError as e:
                failures.append(str(e).splitlines()[0])
    assert not failures, f"{len(failures)} of {len(ZERO_GRAD_CASES) * WORLD}:\n" + "\n".join(failures)


# ---- activation checkpointing and eval forwards ------------------------------------------------
def _checkpoint_blocks(model: torch.nn.Module, use_reentrant: bool) -> None:
    """Each block recomputes its forward in backward (the block's own hooks run once)."""
    for block in model.transformer.h:
        inner = block.forward
        block.forward = lambda x, inner=inner: checkpoint(inner, x, use_reentrant=use_reentrant)


def _checkpoint_block_calls(model: torch.nn.Module, use_reentrant: bool) -> None:
    """The model calls checkpoint(block, x), as Hugging Face models do: the recompute in backward
    calls the block module again, so its forward hooks run a second time, inside backward."""
    def forward(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = model.transformer
        x = t.drop(t.wte(idx) + t.wpe(torch.arange(idx.shape[1])))
        for block in t.h:
            x = checkpoint(block, x, use_reentrant=use_reentrant)
        logits = model.lm_head(t.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
    model.forward = forward


CHECKPOINT_STYLES = {"inside the block": _checkpoint_blocks, "around the block call": _checkpoint_block_calls}
CHECKPOINT_CASES = [(stage, style, reentrant) for stage in (0, 1, 2, 3) for style in CHECKPOINT_STYLES
                    for reentrant in (True, False)]


def _checkpoint_and_eval_cases(rank: int, world: int) -> dict:
    import zerokit

    out = {}
    for case in CHECKPOINT_CASES:
        stage, style, reentrant = case
        model = tiny_gpt()
        CHECKPOINT_STYLES[style](model, reentrant)
        engine, _, _, _ = zerokit.initialize(model=model, config=_config(stage))
        try:
            losses = _loop(engine, global_batches(STEPS, MICRO * world * GAS), rank, world, GAS)
            out[case] = (losses, engine.consolidated_fp32_state_dict())
        except Exception as e:  # reported per case by the test
            out[case] = f"{type(e).__name__}: {e}"
        engine.destroy()
    eval_batch = rank_micro_batch(global_batches(1, MICRO * world, seed=99)[0], rank, world, 0, 1)
    for with_eval in (False, True):
        model = tiny_gpt()
        engine, _, _, _ = zerokit.initialize(model=model, config=_config(3))
        eval_losses = []

        def evaluate(_step: int) -> None:
            engine.eval()
            with torch.no_grad():
                eval_losses.append(engine(*eval_batch).item())
            engine.train()
        losses = _loop(engine, global_batches(STEPS, MICRO * world * GAS), rank, world, GAS,
                       between_steps=evaluate if with_eval else None)
        out[("eval", with_eval)] = (losses, engine.consolidated_fp32_state_dict(), eval_losses)
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def checkpoint_and_eval_results() -> list[dict]:
    return run_world(_checkpoint_and_eval_cases, WORLD, timeout=600)


def test_checkpointed_blocks_match_reference(checkpoint_and_eval_results) -> None:
    ref = _reference()
    for rank, result in enumerate(checkpoint_and_eval_results):
        for case in CHECKPOINT_CASES:
            what = f"stage {case[0]} checkpoint {case[1]} (use_reentrant={case[2]}) rank {rank}"
            assert not isinstance(result[case], str), f"{what}: {result[case]}"
            _assert_fp32_equal(what, *result[case], ref)


def test_stage3_eval_forwards_between_steps_change_nothing(checkpoint_and_eval_results) -> None:
    ref = _reference()
    results = checkpoint_and_eval_results
    for rank, result in enumerate(results):
        plain, evaluated = result[("eval", False)], result[("eval", True)]
        _assert_fp32_equal(f"stage 3 with eval forwards, rank {rank}", *evaluated[:2], ref)
        assert plain[0] == evaluated[0], "eval forwards changed the training losses"
        for name, w in plain[1].items():
            assert torch.equal(w, evaluated[1][name]), f"eval forwards changed {name}"
    # The eval loss after each step is the reference model's loss on the eval batch then.
    x, y = global_batches(1, MICRO * WORLD, seed=99)[0]
    want = []
    for steps in range(1, STEPS + 1):
        _, weights = _reference(steps=steps)
        model = tiny_gpt()
        model.load_state_dict(weights, strict=False)
        model.eval()
        with torch.no_grad():
            want.append([model(*rank_micro_batch((x, y), r, WORLD, 0, 1)).item() for r in range(WORLD)])
    for rank, result in enumerate(results):
        torch.testing.assert_close(torch.tensor(result[("eval", True)][2]),
                                   torch.tensor([w[rank] for w in want]), rtol=1e-5, atol=1e-6)


# ---- after step(): parameters, static loss scale overflow, a failing optimizer -----------------
READ_CASES = [(stage, dtype) for stage in (0, 1, 2) for dtype in ("fp32", "bf16")]


class FailsOnce(torch.optim.SGD):
    """SGD whose second step raises before touching anything."""

    def __init__(self, params, **kw) -> None:
        super().__init__(params, **kw)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("injected optimizer failure")
        return super().step(closure)


def _read_after_step(engine, model, mismatches: list, what: str):
    """Reads every parameter right after step(), before anything else can wait for the weights."""
    def check() -> None:
        read = {n: p.detach().clone() for n, p in model.named_parameters()}
        masters = engine.consolidated_fp32_state_dict()
        mismatches.extend(f"{what}: {n}" for n, w in read.items()
                          if not torch.equal(w, masters[n].to(w.dtype)))
    return check


def _after_step_cases(rank: int, world: int) -> dict:
    import zerokit

    out: dict = {"torn": []}
    for stage, dtype in READ_CASES:
        model = tiny_gpt()
        engine, _, _, _ = zerokit.initialize(model=model, config=_config(stage, dtype, gas=1))
        _loop(engine, global_batches(STEPS, MICRO * world), rank, world, 1,
              after_step=_read_after_step(engine, model, out["torn"], f"stage {stage} {dtype}"))
        engine.destroy()
    for stage in (1, 2):  # the opt-in overlap of the weights' all-gather with the next forward
        engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config=_config(
            stage, gas=1, zero_optimization={"stage": stage, "reduce_bucket_size": 2000,
                                             "async_weight_publish": True}))
        losses = _loop(engine, global_batches(STEPS, MICRO * world), rank, world, 1)
        out[("async publish", stage)] = (losses, engine.consolidated_fp32_state_dict())
        engine.destroy()
    for stage in (0, 2):  # an inf gradient on one rank, under a static fp16 loss scale
        model = tiny_gpt()
        engine, _, _, _ = zerokit.initialize(model=model, config=_config(
            stage, gas=1, fp16={"enabled": True, "loss_scale": 256}))
        record = []
        for step, batch in enumerate(global_batches(3, MICRO * world)):
            handle = None
            if step == 1 and rank == world - 1:
                handle = model.transformer.h[0].mlp.c_fc.weight.register_hook(lambda g: g * math.inf)
            before = engine.consolidated_fp32_state_dict()
            engine.backward(engine(*rank_micro_batch(batch, rank, world, 0, 1)))
            engine.step()
            if handle is not None:
                handle.remove()
            after = engine.consolidated_fp32_state_dict()
            changed = any(not torch.equal(before[k], after[k]) for k in before)
            finite = all(torch.isfinite(v).all() for v in after.values())
            record.append((changed, finite, engine.skipped_steps, engine.loss_scale))
        out[("static overflow", stage)] = record
        engine.destroy()
    for stage in (0, 1, 2, 3):
        model = tiny_gpt()
        engine, _, _, _ = zerokit.initialize(
            model=model, optimizer=lambda groups: FailsOnce(groups, **SGD), config={
                k: v for k, v in _config(stage).items() if k != "optimizer"})
        errors, torn = [], []
        for i, batch in enumerate(global_batches(STEPS + 1, MICRO * world * GAS)):
            for micro in range(GAS):
                engine.backward(engine(*rank_micro_batch(batch, rank, world, micro, GAS)))
                try:
                    engine.step()
                except RuntimeError as e:
                    errors.append((i, str(e), getattr(e, "__notes__", [])))
                    if stage < 3:
                        _read_after_step(engine, model, torn, f"failed step, stage {stage}")()
        out[("failing optimizer", stage)] = (errors, torn, engine.consolidated_fp32_state_dict(),
                                             engine.global_steps)
        engine.destroy()
    out["failing offload"] = _failing_offloaded_step(rank, world)
    return out


def _failing_offloaded_step(rank: int, world: int) -> tuple:
    """Twin-Flow (half of each shard stepped by the host kernel in a worker thread): the device
    optimizer raises once while the host part steps."""
    import zerokit

    model = tiny_gpt()
    engine, optimizer, _, _ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})
    step, calls = optimizer.step, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected optimizer failure")
        return step(*args, **kwargs)
    optimizer.step = fails_once
    errors, torn = [], []
    for i, batch in enumerate(global_batches(STEPS + 1, MICRO * world)):
        engine.backward(engine(*rank_micro_batch(batch, rank, world, 0, 1)))
        try:
            engine.step()
        except RuntimeError as e:
            errors.append(i)
            _read_after_step(engine, model, torn, "failed offloaded step")()
    weights = engine.consolidated_fp32_state_dict()
    finite = all(torch.isfinite(w).all() for w in weights.values())
    result = (errors, torn, finite, engine.global_steps)
    engine.destroy()
    return result


@pytest.fixture(scope="module")
def after_step_results() -> list[dict]:
    return run_world(_after_step_cases, WORLD, timeout=600)


def test_parameters_read_right_after_step_are_the_new_weights(after_step_results) -> None:
    for rank, result in enumerate(after_step_results):
        assert not result["torn"], (f"rank {rank}: parameters read right after step() differ from "
                                    f"the new weights: {result['torn'][:5]}")


def test_async_weight_publish_trains_like_the_reference(after_step_results) -> None:
    ref = _reference(gas=1)
    for rank, result in enumerate(after_step_results):
        for stage in (1, 2):
            _assert_fp32_equal(f"stage {stage} async_weight_publish rank {rank}",
                               *result[("async publish", stage)], ref)


def test_static_loss_scale_overflow_skips_the_step(after_step_results) -> None:
    for rank, result in enumerate(after_step_results):
        for stage in (0, 2):
            record = result[("static overflow", stage)]
            assert [r[:3] for r in record] == [(True, True, 0), (False, True, 1), (True, True, 1)], \
                f"stage {stage} rank {rank}: static loss scale overflow not skipped: {record}"
            assert all(r[3] == 256.0 for r in record), record


def test_a_failed_optimizer_step_leaves_the_engine_training_on(after_step_results) -> None:
    """The failed step counts as not taken: the reference skips that batch."""
    _, ref_weights = _reference(steps=STEPS + 1, skip=(1,))
    for rank, result in enumerate(after_step_results):
        for stage in (0, 1, 2, 3):
            errors, torn, weights, global_steps = result[("failing optimizer", stage)]
            what = f"stage {stage} rank {rank}, optimizer failed at step 1"
            assert [e[:2] for e in errors] == [(1, "injected optimizer failure")], f"{what}: {errors}"
            for name, w in ref_weights.items():
                torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{what}, {name}: {m}")
            assert not torn, f"{what}: parameters differ from the masters after the failure: {torn[:5]}"
            assert global_steps == STEPS, what
            if sys.version_info >= (3, 11):  # exceptions carry notes from 3.11
                assert any("gradients were discarded" in n for n in errors[0][2]), f"{what}: no note"
        # Offloaded: the host part stepped before the device optimizer raised (that update stays,
        # as the note says); the host worker was joined and its weights published, so parameters
        # equal the masters at once, and training goes on.
        errors, torn, finite, global_steps = result["failing offload"]
        assert errors == [1] and not torn and finite and global_steps == STEPS, \
            f"rank {rank}, offloaded: errors {errors}, torn {torn[:5]}, finite {finite}, steps {global_steps}"


# ---- an optimizer that raises on one rank only -------------------------------------------------
def _one_rank_fails(rank: int, world: int) -> dict:
    """Rank world-1's optimizer raises at its second step; the other ranks' do not."""
    import zerokit

    out = {}
    for stage in (0, 2):
        make = (lambda groups: FailsOnce(groups, **SGD)) if rank == world - 1 else \
            (lambda groups: torch.optim.SGD(groups, **SGD))
        engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), optimizer=make, config={
            k: v for k, v in _config(stage, gas=1).items() if k != "optimizer"})
        errors = []
        for i, batch in enumerate(global_batches(STEPS + 1, MICRO * world)):
            engine.backward(engine(*rank_micro_batch(batch, rank, world, 0, 1)))
            try:
                engine.step()
            except RuntimeError as e:
                errors.append((i, type(e).__name__, str(e)))
                if i > 1:
                    break
        weights = engine.consolidated_fp32_state_dict() if stage else {}
        out[stage] = (errors, weights)
        engine.destroy()
    return out


def test_an_optimizer_failing_on_one_rank_is_named_where_replicas_would_differ() -> None:
    """Stage 0 keeps a full replica per rank: a step applied by some ranks only leaves them
    different, so every rank stops at the next step naming the rank that abandoned it. At
    stage 2 each rank steps its own shard: training goes on, and every rank holds the same
    weights."""
    results = run_world(_one_rank_fails, WORLD, timeout=300)
    failing = WORLD - 1
    for rank, result in enumerate(results):
        errors, _ = result[0]
        own = [(1, "RuntimeError", "injected optimizer failure")] if rank == failing else []
        assert errors[:len(own)] == own, (rank, errors)
        rest = errors[len(own):]
        assert len(rest) == 1 and rest[0][0] == 2 and rest[0][1] == "CollectiveError", (rank, errors)
        assert f"rank(s) [{failing}] abandoned their previous step" in rest[0][2], rest[0][2]
        assert "replicas now differ" in rest[0][2], rest[0][2]
        errors, weights = result[2]
        assert [e[:2] for e in errors] == ([(1, "RuntimeError")] if rank == failing else []), errors
        for name, w in weights.items():
            assert torch.equal(w, results[0][2][1][name]), f"stage 2 rank {rank}: {name} differs"
