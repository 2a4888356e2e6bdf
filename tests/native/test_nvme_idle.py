"""The disk's idle time: per step, how long no read, no write, and nothing was in flight.

An I/O engine's idle clock (csrc/aio/activity.h, io/_fallback.py Activity) counts a request as in
flight from its submission until its last block ends, whoever waits for it and when. On the
Python engine with each block slowed to a known time the busy intervals are certain; the native
backends are checked for the same accounting of idle gaps they cannot fake.
"""
import time
import warnings

import pytest
import torch

from zerokit.io import AioConfig, AsyncIO, aligned_empty
from zerokit.io import _fallback
from zerokit.tiers import Ledger
from zerokit.tiers.nvme import NvmeTier

from _aio_backends import BACKENDS

CFG = AioConfig(block_size=16384, queue_depth=4)
SLOW = 0.3  # seconds each block of the slowed engine takes
GAP = 0.2  # seconds the tests leave the disk idle on purpose


def _buf(n):
    return aligned_empty(n * 4).view(torch.float32)


@pytest.fixture
def slow_blocks(monkeypatch):
    """The Python engine's blocks each take SLOW seconds more: a disk whose busy time is known."""
    block = _fallback.Engine._block

    def slow(*args):
        time.sleep(SLOW)
        return block(*args)
    monkeypatch.setattr(_fallback.Engine, "_block", staticmethod(slow))


def _tier(tmp_path, backend):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return NvmeTier(Ledger(), str(tmp_path), config=CFG, backend=backend)


def test_idle_and_busy_intervals_on_a_slow_disk(tmp_path, slow_blocks):
    tier = _tier(tmp_path, "python")
    try:
        r = tier.allocate("u/master", "master", 1024, torch.float32)  # one block
        w = tier.allocate("u/grad", "optimizer_state", 1024, torch.float32)
        tier.stats.reset()
        time.sleep(GAP)  # nothing in flight
        t0 = time.perf_counter()
        read = tier.read(r, _buf(1024))
        time.sleep(SLOW / 2)
        write = tier.write(w, _buf(1024).fill_(1.0))  # overlaps the read's second half
        read.wait()
        write.wait()
        busy = time.perf_counter() - t0  # the union of both, at least 1.5 x SLOW
        time.sleep(GAP)  # idle again
        s = tier.stats.take()
        assert s["window_s"] >= 2 * GAP + 1.5 * SLOW
        # nothing in flight: the two gaps, never the busy union
        assert 2 * GAP <= s["idle_s"] <= s["window_s"] - 1.5 * SLOW + 0.02
        assert abs(s["idle_s"] - (s["window_s"] - busy)) < 0.05
        # no read: everything but the read's SLOW; no write: everything but the write's SLOW
        assert s["window_s"] - SLOW - 0.05 <= s["read_idle_s"] <= s["window_s"] - SLOW + 0.02
        assert s["window_s"] - SLOW - 0.05 <= s["write_idle_s"] <= s["window_s"] - SLOW + 0.02
        # take() reset the window: a quiet moment after it is all idle
        time.sleep(0.05)
        s = tier.stats.take()
        assert s["idle_s"] == pytest.approx(s["window_s"], abs=0.01)
        assert s["read_idle_s"] == pytest.approx(s["window_s"], abs=0.01)
    finally:
        tier.close()


def test_a_request_counts_as_busy_until_its_last_block_not_its_wait(tmp_path, slow_blocks):
    """Busy is the engine's own time: a request that ended long before anyone waited for it is
    idle time after its end; one of many blocks is busy until the last of them ends."""
    tier = _tier(tmp_path, "python")
    try:
        n = 4 * 4096  # four blocks of 16 KiB, run by four threads at once: one SLOW in all
        r = tier.allocate("u/master", "master", n, torch.float32)
        tier.stats.reset()
        h = tier.read(r, _buf(n))
        time.sleep(SLOW + GAP)  # the read ends after SLOW; nobody waits until now
        h.wait()
        s = tier.stats.take()
        assert s["idle_s"] >= GAP - 0.02
        assert s["window_s"] - s["idle_s"] == pytest.approx(SLOW, abs=0.08)
    finally:
        tier.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_counts_gaps_and_not_its_requests(tmp_path, backend):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        aio = AsyncIO(CFG, backend=backend)
    try:
        path = str(tmp_path / "f")
        data = _buf(1 << 18).fill_(2.0)  # 1 MiB
        a = aio.idle_s()
        time.sleep(GAP)
        b = aio.idle_s()
        assert all(y - x >= GAP - 0.01 for x, y in zip(a, b)), (a, b)
        for _ in range(20):  # busy stretches
            aio.write(path, data).wait()
            aio.read(path, data).wait()
        c = aio.idle_s()
        read_idle, write_idle, idle = (y - x for x, y in zip(b, c))
        # nothing in flight only when neither a read nor a write is
        assert idle <= min(read_idle, write_idle) + 1e-6
        assert read_idle >= 0 and write_idle >= 0 and idle >= 0
        # a read of 1 MiB ends in far less than GAP: the rest of the wait before it is idle
        h = aio.read(path, data)
        time.sleep(GAP)
        h.wait()
        d = aio.idle_s()
        assert d[2] - c[2] >= GAP - 0.1 and d[0] - c[0] >= GAP - 0.1, (c, d)
    finally:
        aio.close()
