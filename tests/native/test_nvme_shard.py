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


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def test_a_slot_is_read_in_place_and_gives_its_pages_back_when_not_gathered(tmp_path):
    """[Note: reading into the weights]: with a slot (the unit's own range of its weights) a read
    the unit asks for lands in the slot, never in the buffer; a gather keeps the slot's pages
    (drop_clean), a read ahead made stale gives them back (RSS measured, not the ledger), and a
    read for anyone else still goes through the buffer."""
    from zerokit.io import huge_pages

    n = 32 << 20  # bf16 elements: 64 MiB, far above RSS noise
    nbytes = n * 2
    ledger = Ledger()
    tier = NvmeTier(ledger, str(tmp_path), config=AioConfig(block_size=1 << 20, queue_depth=4))
    file = tier.allocate("u0/shard", "weights", n, torch.bfloat16)
    buffer = aligned_empty(nbytes).view(torch.bfloat16)
    slot = aligned_empty(nbytes).view(torch.bfloat16)  # as the unit's flat: pages given back
    huge_pages.release(slot.data_ptr(), nbytes)
    s = NvmeShard(tier, file, buffer, ledger, slot=slot)
    try:
        values = torch.randn(n).to(torch.bfloat16)
        s.write_values(values)  # the construction buffer is stale: freed
        assert buffer.untyped_storage().nbytes() == 0
        before = _rss()
        s.fetch(into_slot=True)
        got = s.ready(into_slot=True)
        assert got is slot and torch.equal(slot, values)
        assert buffer.untyped_storage().nbytes() == 0  # the buffer never held them
        assert ledger.bytes(kind="buffers") == nbytes
        assert _rss() - before > 0.9 * nbytes  # the read faulted the slot's pages in
        s.drop_clean()  # gathered: the values are the unit's weights now
        assert torch.equal(slot, values) and _rss() - before > 0.9 * nbytes
        assert ledger.bytes(kind="buffers") == 0
        huge_pages.release(slot.data_ptr(), nbytes)  # the unit releases its weights
        assert _rss() - before < 0.1 * nbytes
        # a read ahead into the released slot, then the file written by someone else: stale,
        # and its pages go back with it
        s.fetch(into_slot=True)
        s.ready(into_slot=True)
        assert _rss() - before > 0.9 * nbytes
        s.write_values(values * 2)
        assert _rss() - before < 0.1 * nbytes and not s.in_host_memory
        assert ledger.bytes(kind="buffers") == 0
        # a read for someone else (shard_values, a gathered unit): through the buffer
        got = s.ready()
        assert got is buffer and torch.equal(got, values * 2)
        assert not torch.equal(slot, values * 2)
    finally:
        s.close()
        tier.close()
