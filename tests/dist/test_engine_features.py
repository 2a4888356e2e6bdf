"""Param groups, frozen parameters, the user's own optimizer and scheduler, and fp16 overflow."""
from __future__ import annotations

import math

import torch

from harness import run_world
from reference import engine_train, global_batches, rank_micro_batch, reference_train, tiny_gpt

STEPS, MICRO = 4, 2


def _groups(model: torch.nn.Module) -> list[dict]:
    """Two groups as users write them: no weight decay (and another lr) for norms."""
    model.transformer.wpe.weight.requires_grad_(False)  # a frozen parameter
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}]


def _run(engine, rank: int, world: int) -> list[float]:
    return engine_train(engine, global_batches(STEPS, MICRO * world), rank, world)


def _user_optimizer_cases(rank: int, world: int) -> dict:
    import zerokit

    out = {}
    for stage in (1, 2):
        # An optimizer instance with param groups, and a torch scheduler built on it.
        model = tiny_gpt()
        user_opt = torch.optim.AdamW(_groups(model), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(user_opt, step_size=2, gamma=0.5)
        engine, opt, _, lr_sched = zerokit.initialize(
            model=model, optimizer=user_opt, lr_scheduler=sched,
            config={"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": stage}})
        losses = _run(engine, rank, world)
        assert lr_sched is sched and sched.optimizer is opt
        frozen_before = tiny_gpt().transformer.wpe.weight
        assert torch.equal(model.transformer.wpe.weight, frozen_before), "frozen weight changed"
        out[("instance", stage)] = (losses, engine.consolidated_fp32_state_dict(), engine.get_lr())
        engine.destroy()
        # A class, with model_parameters as param groups.
        model = tiny_gpt()
        engine, _, _, _ = zerokit.initialize(
            model=model, optimizer=torch.optim.AdamW, model_parameters=_groups(model),
            config={"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": stage}})
        out[("class", stage)] = (_run(engine, rank, world), engine.consolidated_fp32_state_dict(), None)
        engine.destroy()
    return out


def test_param_groups_frozen_user_optimizer_and_scheduler() -> None:
    world = 2
    results = run_world(_user_optimizer_cases, world)

    for kind in ("instance", "class"):
        # The reference: plain torch with the same groups, frozen weight and (for "instance") StepLR.
        master = tiny_gpt()
        opt = torch.optim.AdamW(_groups(master), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if kind == "instance" else None
        losses = []
        for x, y in global_batches(STEPS, MICRO * world):
            loss = master(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
            losses.append(loss.item())
        for stage in (1, 2):
            for rank_result in results:
                got_losses, weights, lrs = rank_result[(kind, stage)]
                torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)
                for name, w in master.named_parameters():
                    torch.testing.assert_close(weights[name], w.detach(), rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"{kind} stage {stage} {name}: {m}")
                if kind == "instance":
                    assert lrs == [g["lr"] for g in opt.param_groups]


def _fp16_overflow(rank: int, world: int, stage: int) -> dict:
    import zerokit

    model = tiny_gpt()
    engine, _, _, _ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
        "zero_optimization": {"stage": stage}})
    batches = global_batches(3, MICRO * world)
    record = []
    for step, batch in enumerate(batches):
        x, y = rank_micro_batch(batch, rank, world, 0, 1)
        handle = None
        if step == 1 and rank == world - 1:  # only the last rank sees an inf gradient
            handle = model.transformer.h[0].mlp.c_fc.weight.register_hook(lambda g: g * math.inf)
        before = engine.consolidated_fp32_state_dict()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if handle is not None:
            handle.remove()
        after = engine.consolidated_fp32_state_dict()
        changed = any(not torch.equal(before[k], after[k]) for k in before)
        record.append((engine.loss_scale, engine.skipped_steps, changed, math.isfinite(loss.item())))
    return record


def test_fp16_overflow_skips_the_step_on_every_rank_and_halves_the_scale() -> None:
    for stage in (0, 2):
        for rank, record in enumerate(run_world(_fp16_overflow, 2, stage)):
            (s0, k0, c0, f0), (s1, k1, c1, _), (s2, k2, c2, _) = record
            assert f0 and c0 and k0 == 0 and s0 == 256.0, (stage, rank, record)
            assert not c1 and k1 == 1 and s1 == 128.0, f"stage {stage} rank {rank}: overflow not skipped: {record}"
            assert c2 and k2 == 1 and s2 == 128.0, (stage, rank, record)
