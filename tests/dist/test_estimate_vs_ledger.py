"""The estimator within 10% of the ledger's measured peak, per tier, on real runs (a subset of
tests/memory_check.py's grid, which prints the whole of it: stages 0-3, cpu and nvme offload,
world 1, 2, 4, the demo GPT and a transformers GPT-2)."""
from __future__ import annotations

import pytest

import memory_check as M
from harness import run_world

CASES = [
    {"stage": 0, "dtype": "bf16"},
    {"stage": 2, "offload_optimizer": "cpu", "dtype": "bf16"},
    {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme", "dtype": "bf16"},
    {"stage": 3, "dtype": "fp32", "zero": {"stage3_param_persistence_threshold": 0,
                                           "stage3_max_reuse_distance": 0,
                                           "stage3_prefetch_bucket_size": 500_000}},
]


@pytest.mark.parametrize("key", ["demo", "hf-gpt2"])
def test_estimates_within_10_percent_of_the_ledger(key: str, tmp_path) -> None:
    if key == "hf-gpt2":
        pytest.importorskip("transformers")
    cases = [dict({"offload_optimizer": "none", "offload_param": "none"}, **c) for c in CASES]
    measured = run_world(M.peaks, 2, key, cases, str(tmp_path), timeout=600)[0]
    for row in M.compare(key, 2, cases, measured, str(tmp_path)):
        for tier in M.TIERS:
            want, got, ratio = row[tier]
            assert abs(ratio - 1) <= 0.10, (row["case"], tier, want, got)
