"""offload_param (stage 3): weight shards on the host tier, copied to the device when gathered.

- parity: offload_param on equals off (fp32 within rtol 1e-6; bf16 within test_parity.py's
  two-part bound), alone and with offload_optimizer (ratio 1, Twin-Flow 0.4, the delayed
  update), at world 1 and 2. On this CPU-only machine the "device" is CPU memory: at world 2
  every gather copies the host shard into the gathered buffer; at world 1 the host shard is the
  weights and nothing is gathered ([Note: one rank's shard is its weights] in policy/layout.py).
- ledger and plan: the weight shards are on the host tier, the device holds weights only while
  gathered, and the start-up plan says so.
- the scheduler still prefetches (which now includes the host -> device copy).
- zero.Init + offload_param builds the same model, and save_16bit_model writes the weights.
- save_checkpoint / load_checkpoint resume exactly with the weight shards on the host.
- stages below 3 are refused with an error naming the key.
"""
from __future__ import annotations

import os

import pytest
import torch

from harness import run_world
from reference import TINY, global_batches, rank_micro_batch, tiny_gpt
from fast_tier import slow_except
from test_offload import LR, STEPS, _close, _config, _train

# (dtype, offload_optimizer ratio or None, delayed update) at stage 3
CASES = [(dtype, ratio, False) for dtype in ("fp32", "bf16") for ratio in (None, 1.0, 0.4)] + \
    [("fp32", 1.0, True), ("bf16", 0.4, True)]


def _param_config(dtype, ratio, delayed, on: bool) -> dict:
    cfg = _config(3, dtype, 1, "AdamW", "", ratio,
                  delayed={"enabled": True, "warmup_steps": 1} if delayed else None)
    if on:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    return cfg


def _param_world(rank: int, world: int) -> dict:
    out = {}
    for case in CASES:
        for on in (False, True):
            out[case, on] = _train(rank, world, _param_config(*case, on))
    return out


@pytest.mark.parametrize("world", slow_except([1, 2], fast=[1]))
def test_offload_param_matches_no_offload_param(world: int) -> None:
    results = [_param_world(0, 1)] if world == 1 else run_world(_param_world, world, timeout=300)
    for rank_result in results:
        for case in CASES:
            off, on = rank_result[case, False], rank_result[case, True]
            _close((3, case[0], 1, "AdamW", "", case), on, off)
            # The weights left the device: all of them on the host tier, none held on the device.
            assert on[2]["host", "weights"] == off[2]["device", "weights"] > 0, case
            assert on[2]["device", "weights"] == 0, case


def _plan_and_prefetch(rank: int, world: int) -> dict:
    import zerokit
    from zerokit.config.plan import explain

    engine, *_ = zerokit.initialize(model=tiny_gpt(), config=_param_config("bf16", None, False, True))
    plan = explain(engine)
    shard_bytes = sum(u.shard.numel() * u.shard.element_size() for u in engine.units)
    for batch in global_batches(2, 2 * world):
        x, y = rank_micro_batch(batch, rank, world, 0, 1)
        engine.backward(engine(x, y))
        engine.step()
    out = {"plan": plan, "host_weights": engine.ledger.bytes(tier="host", kind="weights"),
           "shard_bytes": shard_bytes, "stats": dict(engine.scheduler.stats),
           "device_weights": engine.ledger.bytes(tier="device", kind="weights"),
           "peak_device_weights": engine.ledger.bytes(tier="device", kind="weights", peak=True)}
    engine.destroy()
    return out


def test_plan_ledger_and_prefetch() -> None:
    for r in run_world(_plan_and_prefetch, 2):
        assert "offload_param: weight shards on the host" in r["plan"], r["plan"]
        assert "weight shards on the host on rank" in r["plan"]
        assert r["host_weights"] == r["shard_bytes"] > 0 and r["device_weights"] == 0
        # Gathered weights appear on the device only while in use (transient peak > 0).
        assert r["peak_device_weights"] > 0
        assert r["stats"]["prefetched"] > 0, r["stats"]  # gathers (and so host copies) ahead of use


def _init_and_export(rank: int, world: int, out_dir: str) -> dict:
    import zerokit
    from zerokit.models import GPT

    results = {}
    for on in (False, True):
        cfg = _param_config("bf16", 1.0, False, on)
        torch.manual_seed(0)
        with zerokit.zero.Init(config=cfg):
            model = GPT(TINY)
        engine, *_ = zerokit.initialize(model=model, config=cfg)
        built = engine.consolidated_fp32_state_dict()
        for batch in global_batches(2, 2 * world):
            x, y = rank_micro_batch(batch, rank, world, 0, 1)
            engine.backward(engine(x, y))
            engine.step()
        files = engine.save_16bit_model(os.path.join(out_dir, f"on{on}"))
        results[on] = {"built": built, "final": engine.consolidated_fp32_state_dict(), "files": files}
        engine.destroy()
    return results


def test_zero_init_and_save_16bit_model(tmp_path) -> None:
    from safetensors.torch import load_file

    plain = tiny_gpt()
    results = run_world(_init_and_export, 2, str(tmp_path))
    for r in results:
        for name, v in plain.state_dict().items():
            assert torch.equal(r[True]["built"][name], v), name
        for name, v in r[False]["final"].items():
            torch.testing.assert_close(r[True]["final"][name], v, rtol=0, atol=2 * LR * STEPS)
    saved_on, saved_off = load_file(results[0][True]["files"][0]), load_file(results[0][False]["files"][0])
    assert saved_on.keys() == saved_off.keys() and saved_on
    for name, v in saved_off.items():
        assert v.dtype == torch.bfloat16
        torch.testing.assert_close(saved_on[name].float(), v.float(), rtol=0, atol=2 * LR * STEPS)
        # the file holds the trained weights (the master rounded), not stale or placeholder values
        torch.testing.assert_close(saved_on[name], results[0][True]["final"][name].to(torch.bfloat16),
                                   rtol=0, atol=0)


def test_offload_param_refused_below_stage_3() -> None:
    import zerokit
    from zerokit.config import ConfigError

    for stage in (0, 1, 2):
        with pytest.raises(ConfigError, match=rf"offload_param.device 'cpu' needs stage 3 \(got stage {stage}\)"):
            zerokit.initialize(model=tiny_gpt(), config={
                "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
                "zero_optimization": {"stage": stage, "offload_param": {"device": "cpu"}}})
    with pytest.raises(ConfigError, match="offload_param.device 'nvme' needs offload_param.nvme_path"):
        zerokit.initialize(model=tiny_gpt(), config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})


@pytest.mark.parametrize("case", [("fp32", None, False), ("bf16", 1.0, False), ("fp32", 0.4, True)])
def test_checkpoint_resume_with_offload_param(tmp_path, case) -> None:
    """save_checkpoint / load_checkpoint with the weight shards on the host: an exact resume."""
    import zerokit

    cfg = _param_config(*case, True)
    batches = global_batches(4, 2)

    def train(engine, part):
        for x, y in part:
            engine.backward(engine(x, y))
            engine.step()
    engine, *_ = zerokit.initialize(model=tiny_gpt(), config=cfg)
    train(engine, batches[:2])
    engine.save_checkpoint(str(tmp_path), tag="t")
    train(engine, batches[2:])
    straight = engine.consolidated_fp32_state_dict()
    engine.destroy()
    engine, *_ = zerokit.initialize(model=tiny_gpt(seed=5), config=cfg)
    engine.load_checkpoint(str(tmp_path), tag="t")
    train(engine, batches[2:])
    resumed = engine.consolidated_fp32_state_dict()
    engine.destroy()
    for name, w in straight.items():
        assert torch.equal(resumed[name], w), name
