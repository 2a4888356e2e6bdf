"""The estimator (zerokit.memory.estimate) against the ledger's measured peak, per tier.

`peaks(rank, world, model_key, cases, nvme_dir)` trains each case for two steps on a gloo rank
(CPU: run it through harness.run_world) and returns the ledger's peak bytes per tier and kind;
`compare` puts them beside the estimate for the same model, config and world. The estimate never
sees the engine: it plans a model on the meta device. Activations are left out of the comparison
(the ledger counts them only under zerokit's activation checkpointing).

    PYTHONPATH=src python tests/memory_check.py      # the whole grid: demo GPT and a GPT-2 config
"""
from __future__ import annotations

import sys
import tempfile

import torch

TIERS = ("device", "host", "nvme")


def model_source(key: str):
    """(a built model, its estimator source, a batch for it): the same shape both ways."""
    from zerokit.memory.sources import gpt_shape
    from zerokit.models import GPT

    if key == "demo":
        cfg = gpt_shape("demo")
        return GPT(cfg), cfg, lambda ids: (ids, ids), lambda m, b: m(*b)
    if key == "hf-gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=3, n_embd=96, n_head=4, vocab_size=1000, n_positions=64)
        return (GPT2LMHeadModel(cfg), cfg, lambda ids: ids,
                lambda m, b: m(input_ids=b, labels=b).loss)
    raise ValueError(f"model key {key!r}: allowed 'demo', 'hf-gpt2'")


def config(case: dict, nvme_dir: str) -> dict:
    zero = {"stage": case["stage"], **case.get("zero", {})}
    for key in ("offload_optimizer", "offload_param"):
        if case.get(key, "none") != "none":
            zero[key] = {"device": case[key], "nvme_path": nvme_dir}
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": case.get("dtype") == "bf16"},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}


def peaks(rank: int, world: int, key: str, cases: list[dict], nvme_dir: str) -> list[dict]:
    import zerokit

    out = []
    for case in cases:
        torch.manual_seed(0)
        model, _, batch, loss_of = model_source(key)
        engine, _, _, _ = zerokit.initialize(model=model, config=config(case, nvme_dir))
        ids = torch.randint(0, 200, (1, 32))
        for _ in range(2):
            engine.backward(loss_of(engine, batch(ids)))
            engine.step()
        out.append({t: {k: v for k, v in kinds.items() if k != "activations"}
                    for t, kinds in engine.ledger.table(peak=True).items()})
        engine.destroy()
    return out


def compare(key: str, world: int, cases: list[dict], measured: list[dict], nvme_dir: str) -> list[dict]:
    """Rows: case, and per tier (estimate, measured, estimate / measured)."""
    from zerokit.memory import estimate

    _, source, _, _ = model_source(key)
    rows = []
    for case, peak in zip(cases, measured):
        est = estimate(source, world, config(case, nvme_dir), cuda=False, seq_len=32)
        row = {"case": case, "model": key, "world": world}
        for tier in TIERS:
            got = sum(peak[tier].values())
            want = est.tier(tier, activations=False)
            row[tier] = (want, got, want / got if got else (1.0 if not want else float("inf")))
        rows.append(row)
    return rows


def grid() -> list[dict]:
    from zerokit.memory import choices

    # stage 3 with no unit kept gathered (no persistence, no reuse): the prefetch decides the peak, with
    # the default bucket (every next unit fits) and with one that holds one block
    lean = [{"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0},
            {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
             "stage3_prefetch_bucket_size": 500_000}]
    return ([dict(c, dtype="bf16") for c in choices()]
            + [dict(stage=3, offload_optimizer="none", offload_param="none", dtype="bf16", zero=z)
               for z in lean])


def main() -> int:
    from harness import run_world

    worst = 0.0
    print(f"{'model':<8} {'world':>5} {'case':<34}" + "".join(
        f"{t + ' est/measured (MiB)':>34}" for t in TIERS))
    for key in ("demo", "hf-gpt2"):
        for world in (1, 2, 4):
            cases = grid()
            with tempfile.TemporaryDirectory() as nvme_dir:
                measured = run_world(peaks, world, key, cases, nvme_dir, timeout=900)[0]
                for row in compare(key, world, cases, measured, nvme_dir):
                    c = row["case"]
                    label = (f"z{c['stage']} opt={c['offload_optimizer']} par={c['offload_param']}"
                             + (" persist=0" if c.get("zero") else "")
                             + (" prefetch=5e5" if "stage3_prefetch_bucket_size" in c.get("zero", {}) else ""))
                    cells = ""
                    for tier in TIERS:
                        want, got, ratio = row[tier]
                        if want or got:
                            worst = max(worst, abs(ratio - 1))
                        cells += f"{want / 2**20:>12.2f} / {got / 2**20:>8.2f} ({ratio:5.3f})"
                    print(f"{key:<8} {world:>5} {label:<34}{cells}", flush=True)
    print(f"largest deviation: {worst:.1%}")
    return 0 if worst <= 0.10 else 1


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    sys.exit(main())
