"""A weight shard on NVMe (tiers/nvme_shard.py): its host buffer moves EMPTY -> READING ->
RESIDENT -> EMPTY through the ShardResidency table (states.py), and a move the table does not list
raises. The values are checked against the tensor written (plain torch), not against zerokit."""
import pytest
import torch

from zerokit.io import AioConfig, aligned_empty
from zerokit.states import IllegalTransition, ShardResidency
from zerokit.tiers import Ledger
from zerokit.tiers.nvme import NvmeTier
from zerokit.tiers.nvme_shard import NvmeShard

N = 3001  # odd: the file's last sector is partial


@pytest.fixture
def shard(tmp_path):
    ledger = Ledger()
    tier = NvmeTier(ledger, str(tmp_path), config=AioConfig(block_size=16384, queue_depth=4))
    file = tier.allocate("u0/shard", "weights", N, torch.bfloat16)
    buffer = aligned_empty(N * 2).view(torch.bfloat16)
    s = NvmeShard(tier, file, buffer, ledger)
    yield s
    s.close()
    tier.close()


def test_the_buffer_moves_through_its_table(shard):
    values = torch.randn(N).to(torch.bfloat16)
    assert shard.residency is ShardResidency.RESIDENT  # built holding the construction values
    shard.write_values(values)  # another tensor's values: the buffer is stale, so it goes
    assert shard.residency is ShardResidency.EMPTY and not shard.in_host_memory
    shard.fetch()
    assert shard.residency is ShardResidency.READING
    assert torch.equal(shard.ready(), values)
    assert shard.residency is ShardResidency.RESIDENT
    shard.drop_clean()
    assert shard.residency is ShardResidency.EMPTY
    shard.drop_clean()  # nothing to drop: no move asked for
    assert shard.residency is ShardResidency.EMPTY


@pytest.mark.parametrize("start, illegal", [
    ("resident", ShardResidency.READING),   # a read over values the buffer holds
    ("empty", ShardResidency.RESIDENT),     # values that were never read
    ("reading", ShardResidency.READING),    # a second read over the one in flight
])
def test_an_illegal_move_raises_naming_the_shard(shard, start, illegal):
    shard.write_values(torch.ones(N, dtype=torch.bfloat16))
    if start == "resident":
        shard.ready()
    elif start == "reading":
        shard.fetch()
    before = shard.residency
    assert before.value == start
    with pytest.raises(IllegalTransition, match=f"weight shard 'u0/shard' host buffer: illegal state "
                                                f"change '{start}' -> '{illegal.value}'"):
        shard._move(illegal)
    assert shard.residency is before


def test_a_buffer_read_again_is_aligned_for_direct_io_and_counted_at_its_size(tmp_path):
    """After the gather frees it, the buffer's next storage starts on a 4 KiB boundary (2 MiB:
    large enough for huge pages), so the read goes to the disk by O_DIRECT, not through the
    engine's bounce buffer; the tensor stays the same object (the unit's `shard`)."""
    from zerokit.io import huge_pages

    n = huge_pages.MIN_BYTES // 2 + 7  # bf16 elements: above the huge-page threshold, odd
    ledger = Ledger()
    tier = NvmeTier(ledger, str(tmp_path), config=AioConfig(block_size=1 << 20, queue_depth=4))
    file = tier.allocate("u0/shard", "weights", n, torch.bfloat16)
    buffer = aligned_empty(n * 2).view(torch.bfloat16)
    s = NvmeShard(tier, file, buffer, ledger)
    try:
        values = torch.randn(n).to(torch.bfloat16)
        for _ in range(2):
            s.write_values(values)  # the buffer is stale: freed
            assert buffer.untyped_storage().nbytes() == 0
            got = s.ready()
            assert got is buffer and buffer.data_ptr() % huge_pages.HUGE_PAGE == 0
            assert torch.equal(got, values)
            assert ledger.bytes(kind="buffers") == n * 2  # the view's bytes, not its over-allocation
            s.drop_clean()
            assert ledger.bytes(kind="buffers") == 0
    finally:
        s.close()
        tier.close()
