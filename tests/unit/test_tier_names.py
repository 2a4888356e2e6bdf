"""tier_names.py TierName: one name per tier in code, the same text everywhere it is printed."""
import json

import pytest
import torch

from zerokit.policy import PartitionPolicy, PlacementPolicy
from zerokit.policy.layout import BufferRecord, plan_layout
from zerokit.tiers import Ledger, TierName


def test_tier_names_print_and_compare_as_their_text():
    assert [str(t) for t in TierName] == ["device", "host", "nvme"]
    assert f"{TierName.HOST:<6}|" == "host  |"
    assert TierName.NVME == "nvme" and {"nvme": 1}[TierName.NVME] == 1
    assert json.dumps({TierName.HOST: TierName.DEVICE}) == '{"host": "device"}'


def test_layout_records_hold_the_enum_and_refuse_an_unknown_tier():
    placement = PlacementPolicy(ratio=0.5)
    layout = plan_layout(1000, 2, 1, PartitionPolicy.for_stage(2), placement, torch.float16,
                         torch.float32, trainable=True)
    assert {r.tier for r in layout.records} == {TierName.DEVICE, TierName.HOST}
    assert all(type(p.tier) is TierName for p in layout.parts)
    assert BufferRecord("x", "master", "host", torch.float32, 0, 4).tier is TierName.HOST
    with pytest.raises(ValueError, match="disk"):
        BufferRecord("x", "master", "disk", torch.float32, 0, 4)


def test_the_ledger_table_reads_as_before():
    ledger = Ledger()
    ledger.hold_bytes("a", "master", "host", 3 << 20)
    ledger.hold_bytes("b", "grads", TierName.DEVICE, 1 << 20)
    assert ledger.bytes(tier="host") == ledger.bytes(tier=TierName.HOST) == 3 << 20
    lines = ledger.format("t").splitlines()
    assert lines[2].split() == ["device", "0.00", "MiB", "1.00", "MiB"] + ["0.00", "MiB"] * 4 \
        + ["0.00", "MiB"] + ["1.00", "MiB"]  # restores (the speculative step), total
    assert lines[3].split()[0] == "host" and lines[3].split()[5] == "3.00"
    with pytest.raises(ValueError, match=r"\('device', 'host', 'nvme'\)"):
        ledger.hold_bytes("c", "master", "disk", 1)
