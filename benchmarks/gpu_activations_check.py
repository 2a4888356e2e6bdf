#!/usr/bin/env python
"""CUDA check of zerokit.activations (needs a GPU): every option's gradients equal those of the
same model without checkpointing bit for bit (dropout on: the CUDA RNG is replayed), host-kept
inputs are pinned and prefetched in reverse order, and the device tier holds at most two layers'
inputs (the one restored and the one in flight) while the host holds all of them.

    PYTHONPATH=src python benchmarks/gpu_activations_check.py

Prints `PASS <case>` / `FAIL <case>: ...` and `SUMMARY: <n> passed, <m> failed` (exit 1 on a failure).
"""
from __future__ import annotations

import sys
import traceback

import torch

from zerokit import activations
from zerokit.models import GPT, GPTConfig
from zerokit.tiers import Ledger

CFG = GPTConfig(vocab_size=256, block_size=128, n_layer=6, n_head=4, n_embd=128, bias=False, dropout=0.1)
B, T = 4, 128
LAYER = B * T * CFG.n_embd * 4
OPTIONS = {
    "plain": {},
    "cpu": dict(checkpoint_in_cpu=True),
    "contiguous": dict(contiguous_checkpointing=True, num_checkpoints=CFG.n_layer),
    "cpu+contiguous": dict(checkpoint_in_cpu=True, contiguous_checkpointing=True, num_checkpoints=CFG.n_layer),
    "cpu+sync+profile": dict(checkpoint_in_cpu=True, synchronize=True, profile=True),
}


def grads(model):
    x = torch.randint(0, 256, (B, T), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    torch.manual_seed(7)
    model(x, x).backward()
    torch.cuda.synchronize()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def model():
    torch.manual_seed(0)
    return GPT(CFG).cuda()


def check(name, opts):
    want = grads(model())
    activations.configure(None, **opts)
    ledger = Ledger()
    activations.use_ledger(ledger)
    m = model()
    activations.apply_activation_checkpointing(m)
    before = dict(activations.STORE.stats)
    got = grads(m)
    bad = [n for n in want if not torch.equal(want[n], got[n])]
    assert not bad, f"gradients differ: {bad[:3]}"
    stats = {k: activations.STORE.stats[k] - before[k] for k in before}
    dev = ledger.bytes("device", "activations", peak=True)
    host = ledger.bytes("host", "activations", peak=True)
    if opts.get("checkpoint_in_cpu"):
        assert stats["prefetched"] == CFG.n_layer - 1, stats
        assert host == CFG.n_layer * LAYER, (host, LAYER)
        assert dev <= 2 * LAYER, (dev, LAYER)
        if not opts.get("contiguous_checkpointing"):
            pass
    else:
        assert dev == CFG.n_layer * LAYER and host == 0, (dev, host)
    return f"stats {stats}, device peak {dev / LAYER:.1f} layers, host peak {host / LAYER:.1f} layers"


def main() -> int:
    passed = failed = 0
    for name, opts in OPTIONS.items():
        try:
            print(f"PASS {name}: {check(name, opts)}", flush=True)
            passed += 1
        except Exception as e:  # noqa: BLE001
            print(f"FAIL {name}: {type(e).__name__}: {e}\n{traceback.format_exc()}", flush=True)
            failed += 1
    activations.configure(None)
    print(f"SUMMARY: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
