"""policy/layout.py: plan_layout, the one place that decides where every byte of a unit lives.

Every expected value is worked out by hand in the test (padding: the unit is padded to a multiple
of world x 32 elements; Twin-Flow: the host share rounded to 64 elements), not by calling the
module's helpers, so a wrong helper cannot agree with itself.
"""
from __future__ import annotations

import pytest
import torch

from zerokit.policy import PartitionPolicy, PlacementPolicy
from zerokit.policy.layout import plan_layout

F32, BF16 = torch.float32, torch.bfloat16


def plan(numel, world, rank, stage, placement=PlacementPolicy(), dtype=F32, reduce=None, **kw):
    kw.setdefault("trainable", True)
    return plan_layout(numel, world, rank, PartitionPolicy.for_stage(stage), placement, dtype,
                       reduce or dtype, **kw)


def rows(layout) -> list[tuple]:
    """(name, kind, tier, dtype, lo, hi, alias_of) per record, in allocation order."""
    return [(r.name, r.kind, r.tier, r.dtype, r.lo, r.hi, r.alias_of) for r in layout.records]


def parts(layout) -> list[tuple]:
    return [(p.tier, p.lo, p.hi) for p in layout.parts]


# ---- geometry: padding and this rank's range, world sizes 1, 2, 4 with odd unit sizes -----------
@pytest.mark.parametrize("numel,world,rank,padded,shard,opt", [
    (100, 1, 0, 128, 128, (0, 128)),      # 100 -> next multiple of 32
    (1, 1, 0, 32, 32, (0, 32)),
    (100, 2, 1, 128, 64, (64, 128)),      # multiple of 64; rank 1 owns the second half
    (129, 2, 0, 192, 96, (0, 96)),        # 129 -> 192 (3 x 64)
    (130, 4, 3, 256, 64, (192, 256)),     # multiple of 128; rank 3 owns the last quarter
    (7, 4, 2, 128, 32, (64, 96)),         # a tiny unit still gives every rank 32 elements
    (512, 4, 1, 512, 128, (128, 256)),    # already a multiple: no padding
])
def test_padding_and_the_ranks_optimizer_range(numel, world, rank, padded, shard, opt) -> None:
    for stage in (1, 2, 3):
        layout = plan(numel, world, rank, stage)
        assert (layout.numel, layout.padded_numel, layout.shard_numel) == (numel, padded, shard)
        assert layout.opt_range == opt
        assert parts(layout) == [("device", *opt)]
    # Stage 0 steps the whole unit on every rank: the optimizer range is all of it.
    assert plan(numel, world, rank, 0).opt_range == (0, padded)


# ---- records and aliases per stage ------------------------------------------------------------
def test_stage0_fp32_is_ddp_master_is_the_weights_and_master_grad_the_grads() -> None:
    layout = plan(100, 2, 1, 0)
    assert rows(layout) == [
        ("weights", "weights", "device", F32, 0, 128, None),
        ("grads", "grads", "device", F32, 0, 128, None),
        ("master", "master", "device", F32, 0, 128, "weights"),
        ("master_grad", "grads", "device", F32, 0, 128, "grads"),
    ]
    assert layout.aliases("master", "weights") and layout.aliases("master_grad", "grads")
    assert not layout.aliases("master", "grads")
    # Aliases own no bytes: exactly what DDP holds, weights and gradients once each.
    assert layout.bytes("device") == {"weights": 128 * 4, "grads": 128 * 4}
    assert layout.bytes("host") == {}


def test_stage0_fp32_with_a_bf16_reduction_keeps_master_grad_apart() -> None:
    layout = plan(100, 1, 0, 0, reduce=BF16)
    assert layout.record("master_grad").alias_of is None
    assert layout.record("master").alias_of == "weights"


def test_stage0_bf16_accumulation_sums_into_the_fp32_master_grad() -> None:
    layout = plan(100, 1, 0, 0, dtype=BF16, grad_accum_steps=2)
    assert rows(layout) == [
        ("weights", "weights", "device", BF16, 0, 128, None),
        ("grads", "grads", "device", BF16, 0, 128, None),
        ("master", "master", "device", F32, 0, 128, None),
        ("master_grad", "grads", "device", F32, 0, 128, None),
        ("grad_acc", "grads", "device", F32, 0, 128, "master_grad"),
    ]
    assert layout.bytes("device") == {"weights": 256, "grads": 256 + 512, "master": 512}
    # Without accumulation there is nothing to sum: no grad_acc.
    assert not plan(100, 1, 0, 0, dtype=BF16).has("grad_acc")


def test_stage1_bf16_accumulation_has_its_own_full_size_fp32_sum() -> None:
    layout = plan(100, 2, 0, 1, dtype=BF16, grad_accum_steps=4)
    # The master gradient is the rank's shard only, so the full-size sum cannot be it.
    assert ("grad_acc", "grads", "device", F32, 0, 128, None) in rows(layout)
    assert ("master_grad", "grads", "device", F32, 0, 64, None) in rows(layout)


def test_stage1_fp32_master_is_the_ranks_slice_of_the_weights() -> None:
    layout = plan(100, 2, 1, 1)
    assert rows(layout) == [
        ("weights", "weights", "device", F32, 0, 128, None),
        ("grads", "grads", "device", F32, 0, 128, None),
        ("master", "master", "device", F32, 64, 128, "weights"),
        ("master_grad", "grads", "device", F32, 64, 128, None),
    ]


def test_stage2_has_no_full_size_gradient() -> None:
    layout = plan(130, 4, 3, 2, dtype=BF16, grad_accum_steps=2)
    assert rows(layout) == [
        ("weights", "weights", "device", BF16, 0, 256, None),
        ("master", "master", "device", F32, 192, 256, None),
        ("master_grad", "grads", "device", F32, 192, 256, None),
    ]


def test_stage3_weights_are_transient_and_the_shard_persists() -> None:
    layout = plan(7, 4, 2, 3)
    assert rows(layout) == [
        ("weights", "weights", "device", F32, 0, 128, None),
        ("shard", "weights", "device", F32, 64, 96, None),
        ("master", "master", "device", F32, 64, 96, "shard"),
        ("master_grad", "grads", "device", F32, 64, 96, None),
    ]
    assert layout.record("weights").transient and not layout.record("shard").transient
    assert not plan(7, 4, 2, 2).record("weights").transient


def test_frozen_units_hold_weights_only() -> None:
    layout = plan(100, 2, 0, 3, trainable=False)
    assert [r.name for r in layout.records] == ["weights", "shard"]
    assert layout.parts == ()


# ---- offload: ZeRO-Offload, Twin-Flow, offload_param -------------------------------------------
def test_twin_flow_splits_the_range_host_first_rounded_to_64() -> None:
    # 1000 elements, 2 ranks: padded 1024, shard 512; 0.3 x 512 = 153.6 -> 128 (2 x 64).
    layout = plan(1000, 2, 1, 2, PlacementPolicy(ratio=0.3), dtype=BF16)
    assert parts(layout) == [("host", 512, 640), ("device", 640, 1024)]
    assert rows(layout) == [
        ("weights", "weights", "device", BF16, 0, 1024, None),
        ("master", "master", "device", F32, 640, 1024, None),
        ("master_grad", "grads", "device", F32, 640, 1024, None),
        ("host_master", "master", "host", F32, 512, 640, None),
        ("host_grad0", "grads", "host", F32, 512, 640, None),
        ("host_out16", "buffers", "host", BF16, 512, 640, None),
    ]
    assert layout.host_numel == 128
    assert layout.bytes("host") == {"master": 512, "grads": 512, "buffers": 256}
    # 0.5 x 512 = 256, a multiple of 64 already.
    assert parts(plan(1000, 2, 1, 2, PlacementPolicy(ratio=0.5))) == [("host", 512, 768),
                                                                      ("device", 768, 1024)]


def test_zero_offload_leaves_an_empty_device_part() -> None:
    layout = plan(100, 2, 0, 1, PlacementPolicy(ratio=1.0))
    assert parts(layout) == [("host", 0, 64), ("device", 64, 64)]
    # fp32 on the device: the (empty) device master is still the weights' slice.
    assert ("master", "master", "device", F32, 64, 64, "weights") in rows(layout)


def test_delayed_update_keeps_two_host_gradients_step_in_backward_none() -> None:
    names = lambda p: [r.name for r in plan(100, 1, 0, 2, p).records if r.tier == "host"]  # noqa: E731
    assert names(PlacementPolicy(ratio=1.0)) == ["host_master", "host_grad0"]
    assert names(PlacementPolicy(ratio=1.0, delayed=True)) == ["host_master", "host_grad0",
                                                               "host_grad1"]
    assert names(PlacementPolicy(ratio=1.0, step_in_backward=True)) == ["host_master"]


def test_a_cuda_device_adds_the_host_staging_buffer() -> None:
    layout = plan(100, 1, 0, 2, PlacementPolicy(ratio=1.0), cuda=True)
    assert ("host_staging", "buffers", "host", F32, 0, 128, None) in rows(layout)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_offload_param_without_delay_updates_the_host_shard_in_place(dtype) -> None:
    placement = PlacementPolicy(ratio=1.0, params_on_host=True)
    layout = plan(100, 2, 1, 3, placement, dtype=dtype)
    assert layout.record("shard").tier == "host"
    assert (layout.record("shard").lo, layout.record("shard").hi) == (64, 128)
    # The device master is not the weights any more (they live on the host): its own buffer.
    assert layout.record("master").alias_of is None
    if dtype == F32:
        assert layout.record("host_master").alias_of == "shard"
        assert not layout.has("host_out16")
    else:
        assert layout.record("host_master").alias_of is None
        assert layout.record("host_out16").alias_of == "shard"
    # With the delay the worker writes while the next forward reads the shard: no aliasing.
    delayed = plan(100, 2, 1, 3, PlacementPolicy(ratio=1.0, params_on_host=True, delayed=True),
                   dtype=dtype)
    assert all(r.alias_of is None for r in delayed.records if r.tier == "host")


# ---- NVMe: offload_optimizer nvme with the max_in_cpu budget, offload_param nvme ---------------
def test_nvme_part_beyond_the_host_budget() -> None:
    placement = PlacementPolicy(ratio=1.0, nvme=True, ram_numel=3000)
    # 5000 elements on 1 rank: padded 5024, all offloaded; 3000 left of the budget -> 2048: the
    # NVMe part, whose gradient goes to a file, starts on a sector (SECTOR_ELEMENTS).
    layout = plan(5000, 1, 0, 3, placement, dtype=BF16, ram_left=3000)
    assert parts(layout) == [("host", 0, 2048), ("nvme", 2048, 5024), ("device", 5024, 5024)]
    assert [row for row in rows(layout) if row[2] != "device"] == [
        ("host_master", "master", "host", F32, 0, 2048, None),
        ("host_grad0", "grads", "host", F32, 0, 2048, None),
        ("host_out16", "buffers", "host", BF16, 0, 2048, None),
        ("nvme_master", "master", "nvme", F32, 2048, 5024, None),
        ("nvme_grad0", "grads", "nvme", F32, 2048, 5024, None),
        ("nvme_out", "buffers", "host", BF16, 2048, 5024, None),
    ]
    assert layout.nvme_numel == 2976 and layout.host_numel == 2048
    assert layout.bytes("nvme") == {"master": 2976 * 4, "grads": 2976 * 4}


def test_bf16_master_on_every_tier() -> None:
    """bf16.bf16_master_weights_and_grads: the host, nvme and device parts' masters and gradients
    are bf16 records (2 bytes per element each), whatever tier; the 16-bit output stays the
    compute dtype. Twin-Flow 0.5 over nvme, 2 ranks, 10,000 elements: padded 10,048, shard
    5,024; 2,496 offloaded, 2,048 of them (a sector) in RAM."""
    placement = PlacementPolicy(ratio=0.5, nvme=True, ram_numel=2100, master_dtype=BF16,
                                state_dtype=BF16)
    layout = plan(10_000, 2, 0, 2, placement, dtype=BF16, reduce=F32, ram_left=2100)
    assert parts(layout) == [("host", 0, 2048), ("nvme", 2048, 2496), ("device", 2496, 5024)]
    assert [row for row in rows(layout) if row[0] not in ("weights",)] == [
        ("master", "master", "device", BF16, 2496, 5024, None),
        ("master_grad", "grads", "device", BF16, 2496, 5024, None),
        ("host_master", "master", "host", BF16, 0, 2048, None),
        ("host_grad0", "grads", "host", BF16, 0, 2048, None),
        ("host_out16", "buffers", "host", BF16, 0, 2048, None),
        ("nvme_master", "master", "nvme", BF16, 2048, 2496, None),
        ("nvme_grad0", "grads", "nvme", BF16, 2048, 2496, None),
        ("nvme_out", "buffers", "host", BF16, 2048, 2496, None),
    ]
    assert layout.bytes("nvme") == {"master": 448 * 2, "grads": 448 * 2}
    assert layout.bytes("device")["master"] == 2528 * 2


@pytest.mark.parametrize("ram_left,expected", [
    (0, [("nvme", 0, 1024), ("device", 1024, 1024)]),           # budget spent: all in files
    (1024, [("host", 0, 1024), ("device", 1024, 1024)]),        # fits exactly: no nvme part
    (5000, [("host", 0, 1024), ("device", 1024, 1024)]),
    (1000, [("nvme", 0, 1024), ("device", 1024, 1024)]),        # less than a sector: none
])
def test_the_host_budget_decides_the_nvme_split(ram_left, expected) -> None:
    placement = PlacementPolicy(ratio=1.0, nvme=True, ram_numel=10_000)
    assert parts(plan(1000, 1, 0, 3, placement, ram_left=ram_left)) == expected


@pytest.mark.parametrize("held,split", [(False, 4096), (True, 4992)])
def test_the_nvme_split_is_on_a_sector_where_the_gradient_goes_to_a_file(held, split) -> None:
    """Gradient pieces land in the NVMe part's file at their offset in the part: the split on
    a sector (2048 elements: 4096 bytes of bf16) keeps every bucket's piece on one; a gradient
    held in RAM has no file, and the split is 64-aligned for the host kernels."""
    from zerokit.io.buffers import SECTOR_ELEMENTS
    from zerokit.policy import placement as placement_module

    assert placement_module.SECTOR_ELEMENTS == SECTOR_ELEMENTS
    placement = PlacementPolicy(ratio=1.0, nvme=True, ram_numel=10_000, nvme_grads_held=held)
    layout = plan(8000, 1, 0, 3, placement, ram_left=5000)
    assert parts(layout) == [("host", 0, split), ("nvme", split, 8000), ("device", 8000, 8000)]


def test_nvme_with_twin_flow_and_delay() -> None:
    # 2 ranks, 10,000 elements: shard 5,024, rank 0; ratio 0.5 -> 2,496 offloaded, budget 2,048.
    placement = PlacementPolicy(ratio=0.5, nvme=True, delayed=True, ram_numel=2100)
    layout = plan(10_000, 2, 0, 2, placement, ram_left=2100)
    assert parts(layout) == [("host", 0, 2048), ("nvme", 2048, 2496), ("device", 2496, 5024)]
    assert [r.name for r in layout.records if r.tier == "nvme"] == ["nvme_master", "nvme_grad0",
                                                                   "nvme_grad1"]


@pytest.mark.parametrize("param_ram_left,tier", [(256, "host"), (255, "nvme"), (0, "nvme")])
def test_offload_param_nvme_keeps_whole_shards_in_the_budget_on_the_host(param_ram_left, tier):
    placement = PlacementPolicy(params_on_nvme=True, param_ram_numel=1000)
    # 1000 elements on 4 ranks: padded 1024, shard 256; rank 3's shard is [768, 1024).
    layout = plan(1000, 4, 3, 3, placement, dtype=BF16, param_ram_left=param_ram_left)
    assert rows(layout)[1] == ("shard", "weights", tier, BF16, 768, 1024, None)
    if tier == "nvme":
        buf = layout.record("shard_buffer")
        assert (buf.tier, buf.kind, buf.lo, buf.hi, buf.transient) == ("host", "buffers", 768,
                                                                       1024, True)
    else:
        assert not layout.has("shard_buffer")


def test_offload_param_nvme_with_an_nvme_optimizer_writes_no_host_copy() -> None:
    placement = PlacementPolicy(ratio=1.0, nvme=True, params_on_nvme=True)
    layout = plan(1000, 1, 0, 3, placement, dtype=BF16)
    # The stream writes the new weights into the shard's file: no nvme_out in host memory.
    assert [r.name for r in layout.records] == ["weights", "shard", "shard_buffer", "master",
                                                "master_grad", "nvme_master", "nvme_grad0"]


def test_records_come_after_what_they_alias_and_names_are_unique() -> None:
    cases = [plan(100, 1, 0, 0, dtype=BF16, grad_accum_steps=2), plan(100, 2, 1, 3),
             plan(1000, 1, 0, 3, PlacementPolicy(ratio=1.0, params_on_host=True))]
    for layout in cases:
        seen: set[str] = set()
        for r in layout.records:
            assert r.alias_of is None or r.alias_of in seen, (r.name, r.alias_of)
            assert r.name not in seen
            seen.add(r.name)
    with pytest.raises(KeyError, match="no buffer 'grads'"):
        plan(100, 2, 0, 2).record("grads")
