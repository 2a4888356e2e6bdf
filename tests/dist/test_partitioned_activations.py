"""partition_activations at model-parallel size 2: a small tensor-parallel block written for the
test (Megatron's column- then row-parallel MLP), whose ranks hold identical copies of the block's
input. Each rank keeps half of every checkpointed input and all-gathers it at recomputation; the
gradients equal those of the same model without checkpointing bit for bit, and those of a
one-process model holding the whole weights within fp32 rounding.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from harness import run_world

D, HIDDEN, LAYERS, B, T = 12, 32, 3, 2, 7  # odd sizes: the flat input (2*7*12) splits with padding


class Mpu:
    """What Megatron-style code passes as `mpu`: the whole world is one model-parallel group."""

    def get_model_parallel_group(self):
        return dist.group.WORLD

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank()

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size()


class _CopyToParallel(torch.autograd.Function):
    """Identity forward; the gradient is summed over the group (each rank's half contributes)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class TensorParallelBlock(nn.Module):
    """x + fc2(gelu(fc1(ln(x)))), fc1 split by output rows and fc2 by input columns over ranks."""

    def __init__(self, full: "FullBlock", rank: int, size: int):
        super().__init__()
        per = HIDDEN // size
        self.ln = nn.LayerNorm(D)
        self.ln.load_state_dict(full.ln.state_dict())
        self.fc1 = nn.Parameter(full.fc1.weight.detach()[rank * per:(rank + 1) * per].clone())
        self.fc2 = nn.Parameter(full.fc2.weight.detach()[:, rank * per:(rank + 1) * per].clone())

    def forward(self, x):
        h = F.gelu(F.linear(_CopyToParallel.apply(self.ln(x)), self.fc1))
        return x + _ReduceFromParallel.apply(F.linear(h, self.fc2))


class FullBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, HIDDEN, bias=False)
        self.fc2 = nn.Linear(HIDDEN, D, bias=False)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def _full_blocks() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(FullBlock() for _ in range(LAYERS))


def _input() -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(1))


def _grads(blocks, checkpoint=None) -> tuple[dict, torch.Tensor]:
    x = _input().requires_grad_(True)
    h = x
    for b in blocks:
        h = b(h) if checkpoint is None else checkpoint(b, h)
    (h * h).sum().backward()
    grads = {n: p.grad.clone() for n, p in blocks.named_parameters()}
    blocks.zero_grad()
    return grads, x.grad


def _run(rank: int, world: int) -> dict:
    from zerokit import activations

    blocks = nn.ModuleList(TensorParallelBlock(f, rank, world) for f in _full_blocks())
    plain, plain_x = _grads(blocks)
    out = {"plain": (plain, plain_x)}
    per_rank_numel = -(-B * T * D // world)
    for name, opts in {
        "partitioned": dict(partition_activations=True),
        "partitioned+cpu": dict(partition_activations=True, checkpoint_in_cpu=True),
        "partitioned+cpu+contiguous": dict(partition_activations=True, checkpoint_in_cpu=True,
                                           contiguous_checkpointing=True, num_checkpoints=LAYERS),
    }.items():
        activations.configure(Mpu(), **opts)
        ledger = activations.SETTINGS.ledger = __import__("zerokit.tiers", fromlist=["L"]).Ledger()
        kept, after_keep = [], []
        store = activations.STORE
        keep = store.keep
        tier = "host" if opts.get("checkpoint_in_cpu") else "device"

        def counted_keep(args, keep=keep, tier=tier):
            kept.append(keep(args))
            after_keep.append(ledger.bytes(tier, "activations"))
            return kept[-1]
        store.keep = counted_keep
        got = _grads(blocks, activations.checkpoint)
        store.keep = keep
        out[name] = got + ({"kept_numel": [p.kept.numel() for k in kept for p in k.pieces if p],
                            "kept_after_forward": after_keep[-1],
                            "expected": LAYERS * per_rank_numel * 4,
                            "device_peak": ledger.bytes("device", "activations", peak=True),
                            "whole": world * per_rank_numel * 4,
                            "pending": len(store.pending)},)
    activations.configure(None)
    activations.SETTINGS.mpu = None
    return out


def test_partitioned_activations_at_model_parallel_two() -> None:
    full = _full_blocks()
    ref, ref_x = _grads(full)
    results = run_world(_run, 2)
    for rank, r in enumerate(results):
        plain, plain_x = r["plain"]
        per = HIDDEN // 2
        # the tensor-parallel block is right: its shards match the one-process model's gradients
        for i in range(LAYERS):
            torch.testing.assert_close(plain[f"{i}.fc1"], ref[f"{i}.fc1.weight"][rank * per:(rank + 1) * per])
            torch.testing.assert_close(plain[f"{i}.fc2"], ref[f"{i}.fc2.weight"][:, rank * per:(rank + 1) * per])
        torch.testing.assert_close(plain_x, ref_x)
        for name in ("partitioned", "partitioned+cpu", "partitioned+cpu+contiguous"):
            grads, x_grad, info = r[name]
            assert torch.equal(x_grad, plain_x), f"rank {rank} {name}: input gradient differs"
            for n, g in plain.items():
                assert torch.equal(grads[n], g), f"rank {rank} {name}: {n} differs bit-wise"
            # each rank kept half of each block's input (rounded up), not the whole
            assert info["kept_numel"] == [-(-B * T * D // 2)] * LAYERS, (name, info)
            assert info["kept_after_forward"] == info["expected"], (name, info)
            # in backward the device holds one whole (gathered) input beside the kept halves
            device_kept = 0 if "cpu" in name else info["expected"]
            assert info["device_peak"] <= device_kept + 2 * info["whole"], (name, info)
            assert info["pending"] == 0
