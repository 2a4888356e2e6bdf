"""PlacementPolicy: the offload_optimizer section as data (which part of a shard goes to the host)."""
from __future__ import annotations

import pytest

from zerokit.config import load_config
from zerokit.policy import PlacementPolicy

BASE = {"train_micro_batch_size_per_gpu": 1}


def _policy(offload: dict | None, stage: int = 2) -> PlacementPolicy:
    zero = {"stage": stage, **({"offload_optimizer": offload} if offload is not None else {})}
    return PlacementPolicy.from_config(load_config({**BASE, "zero_optimization": zero}).zero_optimization)


def test_defaults_and_ratios() -> None:
    assert not _policy(None).offloads and not _policy({"device": "none", "ratio": 0.5}).offloads
    full = _policy({"device": "cpu"})
    assert full.ratio == 1.0 and full.host_numel(4096) == 4096 and full.host_numel(96) == 96
    half = _policy({"device": "cpu", "ratio": 0.4})
    k = half.host_numel(10_240)
    assert k % 64 == 0 and abs(k - 4096) <= 32
    assert _policy({"device": "cpu", "ratio": 0.0}).host_numel(4096) == 0
    assert "Twin-Flow" in half.describe() and "ZeRO-Offload" in full.describe()
    delayed = _policy({"device": "cpu", "delayed_update": {"enabled": True, "warmup_steps": 3}})
    assert delayed.delayed and delayed.warmup_steps == 3 and "stale" in delayed.describe()
    assert _policy({"device": "cpu", "ratio": "auto"}).auto


@pytest.mark.parametrize("offload, stage, words", [
    ({"device": "cpu"}, 0, ["needs stage 1, 2 or 3"]),
    ({"device": "nvme"}, 2, ["'nvme' is not implemented"]),
    ({"device": "cpu", "ratio": -0.1}, 2, ["ratio must be in [0, 1]", "-0.1"]),
    ({"device": "cpu", "ratio": 0.5, "delayed_update": {"enabled": True}}, 2, ["needs ratio 1"]),
    ({"device": "cpu", "pin_memroy": True}, 2, ["did you mean 'pin_memory'"]),
])
def test_errors_name_the_key(offload, stage, words) -> None:
    with pytest.raises(ValueError) as e:
        _policy(offload, stage)
    for w in words:
        assert w in str(e.value), str(e.value)
