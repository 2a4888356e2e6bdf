"""A DeepSpeed-style training script, run unchanged on zerokit.compat.deepspeed at world size 2.

The script (`_script`, written for this test) does what DeepSpeed examples do: parse
`--deepspeed_config` with deepspeed.add_config_arguments, build its own optimizer
(FusedAdam, or DeepSpeedCPUAdam with offload_optimizer) and a torch LR scheduler, pass
`args=`, `training_data=` to deepspeed.initialize, train from the returned dataloader, save a
checkpoint with client_state, and resume from it in a fresh engine.

Checked against a one-process torch loop (tests/reference.py style) over the very global
batches the ranks drew (gathered each step): losses per step and the final fp32 weights,
element-wise; and the resumed run against the uninterrupted one (weights, batches, lr).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from harness import run_world
from reference import SEQ, tiny_gpt
from fast_tier import slow_except

STEPS, SAVE_AT, MICRO, GAS, LR, WD = 4, 2, 2, 2, 2e-3, 0.1
# Adam divides by the gradient's RMS, so an element whose true gradient is ~0 moves by up to lr on
# float noise alone (see test_parity.py); eps well above that noise keeps such elements still and
# the element-wise comparison meaningful, while ordinary gradients (~1e-3) stay Adam-normalized.
EPS = 1e-5


def _lr_lambda(step: int) -> float:  # warm up over 2 steps, then constant
    return min(1.0, (step + 1) / 2)


def _dataset(n: int = 64) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (n, SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def _config(offload: bool) -> dict:
    zero = {"stage": 2, "reduce_bucket_size": 2000}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    # gradient_clipping 0: the reference loop does not clip (DeepSpeed's default, which
    # deepspeed.initialize applies to a config without the key, is 1.0).
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "gradient_clipping": 0.0, "zero_optimization": zero}


def _script(argv: list[str], optimizer_name: str, ckpt: str, resume: bool, steps: int):
    """What a user's DeepSpeed training script does; returns what the test compares."""
    import argparse

    import zerokit.compat.deepspeed as deepspeed
    from zerokit.compat.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)

    model = tiny_gpt()
    opt_cls = {"FusedAdam": FusedAdam, "DeepSpeedCPUAdam": DeepSpeedCPUAdam}[optimizer_name]
    optimizer = opt_cls(model.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda)
    engine, ds_optimizer, loader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, optimizer=optimizer, lr_scheduler=scheduler, training_data=_dataset())
    client = None
    if resume:
        path, client = engine.load_checkpoint(ckpt)
        assert path is not None
    world = deepspeed.comm.get_world_size()
    losses, seen, lrs = [], [], []
    batches = iter(loader)
    while engine.global_steps < steps:
        window_x, window_y, step_loss = [], [], 0.0
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = next(batches)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            window_x.append(x)
            window_y.append(y)
            step_loss += loss.item() / engine.gradient_accumulation_steps()
        # The global batch of this step, every rank's rows, for the reference.
        mine = torch.cat([torch.cat(window_x), torch.cat(window_y)], dim=1)
        every = [torch.empty_like(mine) for _ in range(world)]
        deepspeed.comm.all_gather(every, mine)
        seen.append(torch.cat(every))
        t = torch.tensor([step_loss])
        deepspeed.comm.all_reduce(t)
        losses.append(t.item() / world)
        lrs.append(lr_scheduler.get_last_lr()[0])
        if not resume and engine.global_steps == SAVE_AT:
            engine.save_checkpoint(ckpt, client_state={"step": engine.global_steps, "note": "ds-script"})
    assert ds_optimizer is engine.optimizer and ds_optimizer.overflow is False  # as DeepSpeed
    assert isinstance(ds_optimizer.optimizer, torch.optim.Optimizer)
    weights = engine.consolidated_fp32_state_dict()
    engine.destroy()
    return losses, seen, lrs, weights, client


def _reference(global_batches: list[torch.Tensor]):
    """Plain torch: AdamW (FusedAdam's and DeepSpeedCPUAdam's default adam_w_mode), same
    LambdaLR, one forward of each whole global batch."""
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
    losses = []
    for rows in global_batches:
        x, y = rows[:, :SEQ].contiguous(), rows[:, SEQ:].contiguous()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _run(rank: int, world: int, tmp: str, optimizer_name: str, offload: bool):
    cfg_path = os.path.join(tmp, "ds_config.json")
    if rank == 0:
        with open(cfg_path, "w") as f:
            json.dump(_config(offload), f)
    torch.distributed.barrier()
    argv = ["--deepspeed", "--deepspeed_config", cfg_path, f"--local_rank={rank}"]
    ckpt = os.path.join(tmp, "ckpt")
    full = _script(argv, optimizer_name, ckpt, resume=False, steps=STEPS)
    resumed = _script(argv, optimizer_name, ckpt, resume=True, steps=STEPS)
    return full, resumed


@pytest.mark.parametrize("optimizer_name,offload", slow_except([("FusedAdam", False), ("DeepSpeedCPUAdam", True)],
                                                             fast=[("FusedAdam", False)]))
def test_deepspeed_script_matches_torch_and_resumes(tmp_path, optimizer_name, offload):
    results = run_world(_run, 2, str(tmp_path), optimizer_name, offload)
    (losses, seen, lrs, weights, _), (r_losses, r_seen, r_lrs, r_weights, client) = results[0]
    assert len(losses) == STEPS and len(seen) == STEPS
    for b in seen:
        assert b.shape[0] == MICRO * GAS * 2  # both ranks' micro-batches of the window
    ref_losses, ref_weights = _reference(seen)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert set(weights) >= set(ref_weights)
    for name, w in ref_weights.items():
        torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # Resume: the client state comes back, the loader continues where the save left it, and the
    # steps after the save repeat the uninterrupted run's.
    assert client["step"] == SAVE_AT and client["note"] == "ds-script"
    assert len(r_seen) == STEPS - SAVE_AT
    for a, b in zip(r_seen, seen[SAVE_AT:]):
        assert torch.equal(a, b)
    assert r_lrs == lrs[SAVE_AT:]
    torch.testing.assert_close(torch.tensor(r_losses), torch.tensor(losses[SAVE_AT:]), rtol=1e-6, atol=1e-7)
    for name, w in weights.items():
        torch.testing.assert_close(r_weights[name], w, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
    # Every rank holds the same consolidated weights.
    for name, w in results[1][0][3].items():
        assert torch.equal(w, weights[name])
