"""The one-process torch loop that parity tests compare zerokit with.

Same model, same seed, the global batch (all ranks' micro-batches of all accumulation steps) in
one forward, the same optimizer on fp32 weights. For bf16 the reference keeps fp32 master weights
and runs forward/backward on a bf16 copy, which is what mixed precision means.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from zerokit.models import GPT, GPTConfig

# No biases: the key projection's bias has an analytically zero gradient (softmax ignores a
# constant added to every score), so its float noise, normalised by Adam to +-lr, would differ
# between any two ways of splitting the batch and make an exact comparison meaningless.
TINY = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=3, n_embd=24, bias=False)
SEQ = 16


def tiny_gpt(seed: int = 0, cfg: GPTConfig = TINY) -> nn.Module:
    torch.manual_seed(seed)
    return GPT(cfg)


def global_batches(steps: int, global_batch: int, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (global_batch, SEQ + 1), generator=g)
        data.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return data


def rank_micro_batch(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world: int, micro: int,
                     gas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows rank `rank` sees at accumulation micro-step `micro` of a global batch."""
    x, y = batch
    per = x.shape[0] // (world * gas)
    lo = (micro * world + rank) * per
    return x[lo:lo + per], y[lo:lo + per]


def reference_train(make_model: Callable[[], nn.Module], make_optimizer: Callable, batches, *,
                    dtype: torch.dtype = torch.float32, clip: float = 0.0, chunks: int = 1):
    """Returns (losses per step, final fp32 master weights by name).

    chunks > 1 (16-bit only): run the global batch as that many equal chunks, each backward's
    16-bit gradients summed in fp32, as data-parallel mixed precision computes them; one 16-bit
    backward over the whole batch rounds differently, which is not what is being tested.

    Runs on one thread, as every rank does (harness.py): MKL's AVX-512 GEMMs sum in an order
    that depends on the thread count, and Adam turns that last-bit difference in a near-zero
    gradient into a fraction of a step (seen: 3.3 lr/100 on one element of 65536, 3 steps).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_train(make_model, make_optimizer, batches, dtype, clip, chunks)
    finally:
        torch.set_num_threads(threads)


def _reference_train(make_model, make_optimizer, batches, dtype, clip, chunks):
    master = make_model()
    opt = make_optimizer(master.parameters())
    compute = make_model().to(dtype) if dtype != torch.float32 else master
    losses = []
    for x, y in batches:
        if compute is not master:
            with torch.no_grad():
                for pc, pm in zip(compute.parameters(), master.parameters()):
                    pc.copy_(pm)
        if compute is master:
            loss = compute(x, y)
            loss.backward()
        else:
            loss = 0.0
            for xc, yc in zip(x.chunk(chunks), y.chunk(chunks)):
                part = compute(xc, yc)
                part.backward()
                loss += part.detach().float() / chunks
                for pc, pm in zip(compute.parameters(), master.parameters()):
                    g = pc.grad.float() / chunks
                    pm.grad = g if pm.grad is None else pm.grad + g
                    pc.grad = None
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().float().clone() for k, v in master.named_parameters()}


def engine_train(engine, batches, rank: int, world: int, gas: int = 1,
                 after_step=None) -> list[float]:
    """The zerokit side of a parity test: each global batch as `gas` micro-steps of this rank's
    rows; returns each step's loss averaged over ranks, comparable with reference_train's.
    after_step(i), if given, runs after global step i (a test's per-step check)."""
    losses = []
    for i, batch in enumerate(batches):
        step_loss = 0.0
        for micro in range(gas):
            x, y = rank_micro_batch(batch, rank, world, micro, gas)
            # The batch goes where the engine computes, as a user's loop puts it (CUDA runs).
            x, y = x.to(engine.device), y.to(engine.device)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / gas
        if after_step is not None:
            after_step(i)
        t = torch.tensor([step_loss])
        if world > 1:
            torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def resume_train(rank: int, world: int, save_cfg: dict, load_cfg: dict, ckpt: str,
                 async_save: bool = False) -> tuple[dict, dict]:
    """A checkpoint round trip (run with run_world): train 2 steps with save_cfg, save, train 1
    more: weights A. A fresh engine (other seed) with load_cfg loads the checkpoint and trains
    the same step: weights B. A == B is an exact resume; the configs may place state anywhere."""
    import zerokit

    batches = global_batches(3, save_cfg["train_micro_batch_size_per_gpu"] * world)
    cfg = dict(save_cfg, checkpoint={"async_save": async_save})
    engine, *_ = zerokit.initialize(model=tiny_gpt(), config=cfg)
    engine_train(engine, batches[:2], rank, world)
    engine.save_checkpoint(ckpt, tag="t")
    engine_train(engine, batches[2:], rank, world)
    a = engine.consolidated_fp32_state_dict()
    engine.destroy()
    engine, *_ = zerokit.initialize(model=tiny_gpt(seed=7), config=load_cfg)
    engine.load_checkpoint(ckpt, tag="t")
    engine_train(engine, batches[2:], rank, world)
    b = engine.consolidated_fp32_state_dict()
    engine.destroy()
    return a, b
