"""One rank reduces nothing ([Note: nothing to reduce at one rank] in units/reduction.py): a bf16
unit's gradients cross to the optimizer parts in bf16 (stage 2-3's bucket in the compute dtype,
below stage 2 the local gradient as it is), and every part widens what it takes, exactly.

- the same bits: weights and losses equal, element for element, those of the same run with the
  bucket forced back to the fp32 reduce dtype, at stages 0-3, with accumulation, device and
  offloaded (host and NVMe) parts, clipping that applies; fails if a part rounds a piece;
- the bytes: the reduction's scratch bucket is taken in bf16 (2 bytes per element, what
  byte_plan.reduce_buffer_bytes counts), and the fp32 one of the forced run is twice its size.
"""
from __future__ import annotations

import pytest
import torch

from harness import run_world
from reference import engine_train, global_batches, tiny_gpt

STEPS, MICRO = 3, 2


def _config(stage, device, gas, path):
    zero = {"stage": stage, "reduce_bucket_size": 2000, "sub_group_size": 1000}
    if device != "none":
        off = {"device": device, "step_in_backward": False}
        if device == "nvme":
            off.update(nvme_path=path, buffer_count=3)
        zero["offload_optimizer"] = off
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "gradient_clipping": 1e-3, "bf16": {"enabled": True}, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}}


def _train(rank, world, cfg, gas, forced_fp32):
    import zerokit
    from zerokit.engine.byte_plan import reduce_buffer_bytes
    from zerokit.tiers.scratch import ScratchCache
    from zerokit.units.reduction import GradientReduction

    if forced_fp32:  # the path before: every bucket in the reduce dtype
        GradientReduction.bucket_dtype = lambda self, local: self.reduce_dtype
    taken = []
    take = ScratchCache.take

    def spy(self, kind, numel, dtype, tier=None):
        taken.append((kind, numel, dtype))
        return take(self, kind, numel, dtype, tier)

    ScratchCache.take = spy
    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config=cfg)
    losses = engine_train(engine, global_batches(STEPS, MICRO * gas), rank, world, gas)
    out = {"losses": losses, "weights": engine.consolidated_fp32_state_dict(),
           # a unit's whole bucket (the gradient files' chunks are scratch buffers too)
           "bucket_dtypes": sorted({str(d) for kind, n, d in taken if kind == "buffers" and n in
                                    {u.padded_numel for u in engine.units}}),
           "planned": reduce_buffer_bytes([u.layout for u in engine.units], engine.policy,
                                          torch.bfloat16, torch.float32,
                                          engine.config.zero_optimization, 1),
           "largest": max(u.layout.padded_numel for u in engine.units),
           "bucketed": engine.policy.shard_gradients}
    engine.destroy()
    return out


@pytest.mark.parametrize("stage,device,gas", [(0, "none", 2), (1, "none", 1), (2, "cpu", 2),
                                              (3, "nvme", 3), (3, "none", 1)])
def test_one_rank_crosses_in_bf16_to_the_same_bits(tmp_path, stage, device, gas):
    cfg = _config(stage, device, gas, str(tmp_path))
    now = run_world(_train, 1, cfg, gas, False)[0]
    before = run_world(_train, 1, cfg, gas, True)[0]
    assert now["losses"] == before["losses"]
    assert now["weights"].keys() == before["weights"].keys()
    for name, w in now["weights"].items():
        assert torch.equal(w, before["weights"][name]), name
    # stage 1 without accumulation has no full-size gradient: it buckets as stage 2 does
    assert now["bucketed"] == (stage >= 2 or (stage == 1 and gas == 1))
    if now["bucketed"]:  # the bucket: bf16 now, fp32 before; counted at its size
        assert "torch.bfloat16" in now["bucket_dtypes"] and "torch.float32" not in now["bucket_dtypes"]
        assert "torch.float32" in before["bucket_dtypes"]
        assert now["planned"] >= 2 * now["largest"] and now["planned"] < 4 * now["largest"]
    else:  # nothing converted below stage 2 (the fp32 sum of accumulation is reduced in place)
        assert now["planned"] == 0
