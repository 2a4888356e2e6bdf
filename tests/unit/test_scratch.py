"""Scratch buffers (tiers/scratch.py): a step's transient host buffers reused, counted while
taken, held (against the budget, in no kind) while idle, freed when a step did not use them.
Page faults are measured with getrusage, not inferred from the cache's own counters."""
from __future__ import annotations

import resource

import pytest
import torch

from zerokit.tier_names import TierName
from zerokit.tiers.ledger import BudgetExceededError, Ledger
from zerokit.tiers.nvme import WRITES_IN_FLIGHT_BYTES

MiB = 1 << 20


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_buffer_given_back_is_the_next_take_of_its_size_without_faulting_it_in() -> None:
    ledger = Ledger()
    n = 16 * MiB // 4
    buf, give_back = ledger.scratch.take("buffers", n, torch.float32, TierName.HOST)
    buf.fill_(1.0)  # first touch: the pages fault in here
    address = buf.data_ptr()
    give_back()
    before = _faults()
    again, give_back = ledger.scratch.take("buffers", n, torch.float32, TierName.HOST)
    again.fill_(2.0)
    faulted = _faults() - before
    assert again.data_ptr() == address
    # 4096 pages would fault in a fresh 16 MiB buffer; a reused one faults none of them
    assert faulted < 64, faulted
    give_back()


def test_counted_as_their_kind_while_taken_and_against_the_budget_only_while_idle() -> None:
    ledger = Ledger(cpu_is_device=False)
    a, give_a = ledger.scratch.take("grads", 1000, torch.float32, TierName.HOST)
    assert a.numel() == 1000 and a.dtype == torch.float32 and a.data_ptr() % 4096 == 0
    assert ledger.bytes(TierName.HOST, "grads") == 4096  # 4000 bytes, rounded to what it holds
    give_a()
    give_a()  # idempotent
    assert ledger.bytes(TierName.HOST) == 0 and ledger.cached_bytes(TierName.HOST) == 4096
    assert ledger.bytes(TierName.HOST, "grads", peak=True) == 4096
    # the host tier is where host memory is counted on a run with a GPU; "device" on a CPU-only one
    b, give_b = ledger.scratch.take("buffers", 10, torch.bfloat16)
    assert ledger.bytes(TierName.HOST, "buffers") == 4096
    give_b()
    assert Ledger(cpu_is_device=True).cpu_tier() is TierName.DEVICE


def test_a_step_frees_the_idle_sizes_it_did_not_take() -> None:
    ledger = Ledger(cpu_is_device=False)
    for n in (1024, 2048):
        ledger.scratch.take("buffers", n, torch.float32)[1]()
    ledger.end_step()  # both sizes taken in this step: kept
    assert ledger.cached_bytes() == 3 * 4096
    ledger.scratch.take("buffers", 1024, torch.float32)[1]()
    ledger.end_step()  # 2048 not taken this step: freed
    assert ledger.cached_bytes() == 4096
    ledger.scratch.drop_idle()
    assert ledger.cached_bytes() == 0 and ledger.scratch.idle_bytes == 0


def test_a_take_past_the_budget_frees_the_idle_buffers_first_then_fails() -> None:
    ledger = Ledger(cpu_is_device=False)
    ledger.set_budget(TierName.HOST, 3 * 4096, "test")
    ledger.scratch.take("buffers", 2048, torch.float32)[1]()  # 8192 idle of a 12288 budget
    # a second size: 8192 idle + 8192 new would cross; dropping the idle one makes room
    c, give_c = ledger.scratch.take("buffers", 2047, torch.float32)
    assert ledger.cached_bytes() == 0 and ledger.bytes(TierName.HOST) == 8192
    with pytest.raises(BudgetExceededError, match="scratch buffers buffer of 2,048 elements"):
        ledger.scratch.take("buffers", 2048, torch.float32)
    give_c()
    assert ledger.bytes(TierName.HOST) == 0 and ledger.cached_bytes() == 8192


@pytest.mark.parametrize("stage,budget", [(2, None), (3, None), (3, "12GiB")])
def test_a_world_1_step_takes_every_reduction_and_gradient_piece_from_the_cache(tmp_path, stage,
                                                                                 budget) -> None:
    """The reduction buckets (units/unit.py) and the gradient pieces written to NVMe files
    (parts/nvme.py) are scratch buffers: after the first step, every take is a reuse, under a
    memory budget too (the plan counts them); the idle ones go with empty_partition_cache."""
    import zerokit
    from reference import tiny_gpt

    torch.set_num_threads(1)
    engine, *_ = zerokit.initialize(model=tiny_gpt(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "offload_optimizer": {
            "device": "nvme", "nvme_path": str(tmp_path), "step_in_backward": False,
            "max_in_cpu": 0,  # set: every part streams from NVMe under the budget too
            "nvme_gradients": "file"}},  # (and its gradients go to files, not held by the planner)
        **({"memory": {"host": budget}} if budget else {})})
    assert engine.ledger.scratch.idle_limit > 0
    stats, counts = engine.ledger.scratch.stats, []
    for _ in range(3):
        x = torch.randint(0, 50, (2, 16))
        engine.backward(engine(x, x))
        engine.step()
        counts.append(dict(stats))
    taken = counts[2]["taken"] - counts[1]["taken"]
    reused = counts[2]["reused"] - counts[1]["reused"]
    # one bucket per unit and at least one gradient piece per unit's nvme part
    assert taken >= 2 * len(engine.units) and reused == taken, counts
    assert engine.ledger.cached_bytes() > 0
    engine.empty_partition_cache()
    assert engine.ledger.cached_bytes() == 0


def test_at_world_1_a_reduction_gives_its_bucket_back_before_the_next_unit_takes_one() -> None:
    """At world 1 a reduction is complete when launched: the engine takes it at once, so one
    unit's bucket is alive at a time (the byte rule engine/byte_plan.py `reduce_buffer_bytes`
    counts, and what the planner leaves for the rest), not every unit's up to
    2 x reduce_bucket_size. Measured as the ledger's peak of reduction buffers in a step."""
    import zerokit
    from reference import tiny_gpt

    torch.set_num_threads(1)
    engine, *_ = zerokit.initialize(model=tiny_gpt(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2}})
    for _ in range(2):
        x = torch.randint(0, 50, (2, 16))
        engine.backward(engine(x, x))
        engine.step()
    buckets = [-(-u.padded_numel * 4 // 4096) * 4096 for u in engine.units]
    assert len(buckets) == 3 and max(buckets) < sum(buckets)
    assert engine.ledger.bytes(engine.ledger.cpu_tier(), "buffers", peak=True) == max(buckets)


def test_a_request_up_to_the_slack_smaller_shares_an_idle_buffer() -> None:
    """An embedding unit and the blocks (sizes within SLACK) share one buffer; a much smaller
    request gets its own. Gradient pieces bound for files go through buffers of at most
    GRAD_CHUNK_BYTES."""
    from zerokit.parts import nvme

    ledger = Ledger(cpu_is_device=False)
    big, give_back = ledger.scratch.take("buffers", 100 * 1024, torch.float32)
    address = big.data_ptr()
    give_back()
    near, give_back = ledger.scratch.take("buffers", 90 * 1024, torch.float32)
    assert near.data_ptr() == address and near.numel() == 90 * 1024
    assert ledger.bytes(TierName.HOST, "buffers") == 100 * 1024 * 4  # what it holds
    give_back()
    far, give_back = ledger.scratch.take("buffers", 50 * 1024, torch.float32)
    assert far.data_ptr() != address
    give_back()
    assert nvme.GRAD_CHUNK_BYTES <= WRITES_IN_FLIGHT_BYTES


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


@pytest.mark.parametrize("freed_by", ["idle_limit", "end_step", "drop_idle"])
def test_a_buffer_the_cache_frees_is_freed_while_its_give_back_is_still_held(freed_by) -> None:
    """RSS, not the cache's counters: a gradient file's write record keeps the give-back function
    until its range is next settled (a micro-step later); the buffer must not live that long."""
    ledger = Ledger(cpu_is_device=False)
    if freed_by == "idle_limit":
        ledger.scratch.idle_limit = 0  # given back = freed
    n = 256 * MiB
    buf, give_back = ledger.scratch.take("buffers", n, torch.uint8, TierName.HOST)
    buf.fill_(1)  # faulted in: resident
    del buf
    held = [give_back]  # as a write record holds it
    before = _rss()
    give_back()
    if freed_by == "end_step":
        ledger.end_step()  # taken this step: kept
        ledger.end_step()  # not taken this step: freed
    elif freed_by == "drop_idle":
        ledger.scratch.drop_idle()
    assert ledger.cached_bytes() == 0 and ledger.bytes(TierName.HOST) == 0
    fell = before - _rss()
    assert fell > 200 * MiB, f"RSS fell by {fell / MiB:.0f} MiB after freeing a 256 MiB buffer"
    assert held


def test_a_write_window_record_holds_no_buffer_once_written(tmp_path) -> None:
    """A write's record (tiers/nvme.py _WindowWrite) outlives the write in its file's list; once
    the write has ended and its buffer gone back to a cache that frees it, RSS falls."""
    from zerokit.tiers.nvme import NvmeTier

    ledger = Ledger(cpu_is_device=False)
    ledger.scratch.idle_limit = 0
    tier = NvmeTier(ledger, tmp_path)
    tier.write_window.limit = 1 << 40  # the record stays open until waited here
    try:
        rng = tier.allocate("g", "grads", 64 * MiB, torch.float32)
        buf, give_back = ledger.scratch.take("buffers", rng.numel, torch.float32, TierName.HOST)
        buf.fill_(1.0)
        record = tier.write_window.add(tier.write(rng, buf), rng.nbytes, give_back)
        del buf, give_back
        before = _rss()
        assert record.open
        record.wait()
        fell = before - _rss()
        assert fell > 200 * MiB, f"RSS fell by {fell / MiB:.0f} MiB once the 256 MiB write ended"
        assert not record.open
    finally:
        tier.close()
