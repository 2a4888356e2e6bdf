"""zerokit.memory.estimate without a run: activations measured on meta against a real forward,
errors naming the argument, the CLI's table. (Against the ledger of real runs:
tests/dist/test_estimate_vs_ledger.py.)"""
from __future__ import annotations

import pytest
import torch

from zerokit.memory import estimate, estimate_grid
from zerokit.memory.activations import measure_forward
from zerokit.models import GPT, GPTConfig


def _saved_by_real_forward(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """The reference: what a real CPU forward saves for backward, one count per storage."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            saved[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, ids)
    return sum(saved.values())


@pytest.mark.parametrize("batch,seq", [(1, 32), (3, 17)])
def test_meta_activations_match_a_real_forward(batch: int, seq: int) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=48, n_head=4, vocab_size=97, block_size=64))
    ids = torch.randint(0, 97, (batch, seq))
    real = _saved_by_real_forward(model, ids)
    meta_ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    on_meta, order = measure_forward(model, {"idx": meta_ids, "targets": meta_ids}, torch.float32,
                                     list(model.transformer.h))
    assert on_meta == real
    assert order == list(model.transformer.h)
    assert all(p.device.type == "cpu" for p in model.parameters())  # the model itself untouched


def test_estimate_allocates_nothing_and_scales_with_world() -> None:
    one, four = (estimate("gpt-1b", w, stage=2, dtype="bf16", activations=False) for w in (1, 4))
    assert one.params == four.params > 9e8
    # ZeRO-2: the 16-bit weights stay whole; master, moments and the gradient shard are 1/N
    assert one.bytes["device"]["weights"] == four.bytes["device"]["weights"]
    assert four.bytes["device"]["optimizer_state"] * 4 == one.bytes["device"]["optimizer_state"]


def test_hf_config_is_built_on_meta() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=32)
    est = estimate(cfg, 2, stage=3, offload_optimizer="cpu", dtype="bf16")
    assert est.bytes["device"]["activations"] > 0
    assert est.tier("host") > 0 and est.tier("nvme") == 0


@pytest.mark.parametrize("kwargs,match", [
    ({"world_size": 0}, "world_size must be a positive int"),
    ({"offload_optimizer": "disk"}, "offload_optimizer must be 'none', 'cpu' or 'nvme'"),
    ({"dtype": "fp8"}, "dtype must be 'fp32', 'bf16' or 'fp16'"),
    ({"config": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": "auto"}}}},
     "ratio 'auto'"),
])
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        estimate("demo", **kwargs)


def test_unknown_shape_names_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="gpt-125m"):
        estimate("gpt-7b-nonexistent")


def test_grid_and_cli(capsys) -> None:
    from zerokit.cli import main

    rows = estimate_grid("demo", 2)
    assert len(rows) == 12 and {r.label for r in rows} >= {"stage 0", "stage 3, optimizer nvme, params nvme"}
    assert main(["estimate", "demo", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "stage 3, optimizer cpu, params cpu" in out and "per rank of 2" in out
