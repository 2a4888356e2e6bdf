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
    twin_delayed = _policy({"device": "cpu", "ratio": 0.5, "delayed_update": {"enabled": True}})
    assert twin_delayed.delayed and "host part's weights one step stale" in twin_delayed.describe()


def test_offload_param_is_placement() -> None:
    zero = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}
    policy = PlacementPolicy.from_config(load_config({**BASE, "zero_optimization": zero}).zero_optimization)
    assert policy.params_on_host and policy.param_pin_memory and not policy.offloads
    assert "weight shards on the host" in policy.describe_params()
    assert not _policy(None, 3).params_on_host


@pytest.mark.parametrize("offload, stage, words", [
    ({"device": "cpu"}, 0, ["needs stage 1, 2 or 3"]),
    ({"device": "nvme"}, 2, ["offload_optimizer.device 'nvme' needs offload_optimizer.nvme_path"]),
    ({"device": "nvme", "nvme_path": "/x"}, 0, ["'nvme' needs stage 1, 2 or 3"]),
    ({"device": "cpu", "ratio": -0.1}, 2, ["ratio must be in [0, 1]", "-0.1"]),
    ({"device": "cpu", "pin_memroy": True}, 2, ["did you mean 'pin_memory'"]),
])
def test_errors_name_the_key(offload, stage, words) -> None:
    with pytest.raises(ValueError) as e:
        _policy(offload, stage)
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("param, stage, words", [
    ({"device": "cpu"}, 2, ["zero_optimization.offload_param.device 'cpu' needs stage 3", "got stage 2"]),
    ({"device": "nvme"}, 3, ["offload_param.device 'nvme' needs offload_param.nvme_path"]),
    ({"device": "nvme", "nvme_path": "/x"}, 2, ["offload_param.device 'nvme' needs stage 3"]),
    ({"device": "cpu", "pin_memroy": True}, 3, ["did you mean 'pin_memory'"]),
])
def test_offload_param_errors_name_the_key(param, stage, words) -> None:
    with pytest.raises(ValueError) as e:
        load_config({**BASE, "zero_optimization": {"stage": stage, "offload_param": param}})
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("numel,world", [(1000, 3), (7 * 15, 2), (31, 1), (4096, 4)])
def test_each_rank_s_shard_range_is_its_chunk(numel, world) -> None:
    """The layout's shard range (what units, checkpoints and zero.Init read instead of
    recomputing it) is rank r's chunk of the padded flat buffer, as torch.chunk cuts it, and is
    the shard record's range at stage 3."""
    import torch

    from zerokit.policy import PartitionPolicy
    from zerokit.policy.layout import plan_layout

    for stage in (1, 3):
        for rank in range(world):
            layout = plan_layout(numel, world, rank, PartitionPolicy.for_stage(stage),
                                 PlacementPolicy(), torch.float16, torch.float32, trainable=True)
            chunk = torch.arange(layout.padded_numel).chunk(world)[rank]
            assert layout.shard_range == (int(chunk[0]), int(chunk[-1]) + 1)
            assert layout.opt_range == layout.shard_range
            if stage == 3:
                shard = layout.record("shard")
                assert (shard.lo, shard.hi) == layout.shard_range
