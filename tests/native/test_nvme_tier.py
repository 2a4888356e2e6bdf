"""The NVMe tier: file ranges allocated, read and written through zerokit.io, counted in the ledger."""
import os

import pytest
import torch

from zerokit.io import AioConfig, AioError, aligned_empty
from zerokit.tiers import Ledger
from zerokit.tiers.nvme import SWAP_DIR, FileRange, NvmeTier

CFG = AioConfig(block_size=16384, queue_depth=4)


def _buf(n, dtype=torch.float32):
    return aligned_empty(n * torch.empty(0, dtype=dtype).element_size()).view(dtype)


@pytest.fixture
def tier(tmp_path):
    t = NvmeTier(Ledger(), str(tmp_path), rank=1, config=CFG)
    yield t
    t.close()


def test_allocate_is_zero_and_counted(tier):
    r = tier.allocate("u0/master", "master", 1001, torch.float32)
    assert os.path.getsize(r.path) == 4004
    assert tier.ledger.bytes("nvme", "master") == 4004
    out = _buf(1001).fill_(7)
    tier.read(r, out).wait()
    assert torch.equal(out, torch.zeros(1001))
    tier.free("u0/master")
    assert tier.ledger.bytes("nvme") == 0 and not os.path.exists(r.path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_and_narrow(tier, dtype):
    n = 5000 + 3
    r = tier.allocate("s", "optimizer_state", n, dtype)
    src = torch.randn(n).to(dtype)
    tier.copy(r, _buf(n, dtype).copy_(src)).wait()
    back = _buf(n, dtype)
    tier.copy(back, r).wait()
    assert torch.equal(back, src)
    piece = r.narrow(1000, 777)  # an unaligned sub-group, as the streaming executor reads
    got = _buf(777, dtype)
    tier.read(piece, got).wait()
    assert torch.equal(got, src[1000:1777])
    tier.write(piece, torch.ones(777, dtype=dtype)).wait()
    tier.read(r, back).wait()
    assert torch.equal(back[1000:1777], torch.ones(777, dtype=dtype))
    assert torch.equal(back[:1000], src[:1000]) and torch.equal(back[1777:], src[1777:])
    s = tier.stats.snapshot()
    esz = src.element_size()
    assert s["bytes_written"] == (n + 777) * esz and s["bytes_read"] == (2 * n + 777) * esz


def test_faults_name_the_file(tier):
    r = tier.allocate("gone", "master", 4096, torch.float32)
    os.unlink(r.path)
    with pytest.raises(AioError, match="gone.swp"):
        tier.read(r, _buf(4096)).wait()
    t = tier.allocate("cut", "master", 4096, torch.float32)
    os.truncate(t.path, 100)
    with pytest.raises(AioError, match="short file.*cut.swp"):
        tier.read(t, _buf(4096)).wait()
    with pytest.raises(ValueError, match="holds 4096"):
        tier.read(t, _buf(10))


def test_stale_files_cleaned_and_close_removes(tmp_path):
    d = tmp_path / SWAP_DIR / "rank0"
    d.mkdir(parents=True)
    (d / "old.swp").write_bytes(b"x" * 10)
    t = NvmeTier(Ledger(), str(tmp_path), config=CFG)
    assert t.stale_files == ["old.swp"] and not (d / "old.swp").exists()
    t.allocate("a", "master", 10, torch.float32)
    t.close()
    assert not d.exists() and t.ledger.bytes("nvme") == 0


def test_narrow_out_of_range():
    r = FileRange("o", "/x", 0, 10, torch.float32)
    assert r.narrow(2, 3).offset == 8
    with pytest.raises(ValueError, match=r"\[8, 13\)"):
        r.narrow(8, 5)
