"""The NVMe tier: file ranges allocated, read and written through zerokit.io, counted in the ledger."""
import os

import pytest
import torch

from zerokit.io import AioConfig, AioError, aligned_empty
from zerokit.tier_names import TierName
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
    d = tmp_path / SWAP_DIR / "rank0"  # the layout before swap directory claims
    d.mkdir(parents=True)
    (d / "old.swp").write_bytes(b"x" * 10)
    other_rank = tmp_path / SWAP_DIR / "rank1"
    other_rank.mkdir()
    (other_rank / "theirs.swp").write_bytes(b"x")
    t = NvmeTier(Ledger(), str(tmp_path), config=CFG)
    assert t.stale_files == ["old.swp"] and not d.exists()
    assert (other_rank / "theirs.swp").exists(), "another rank's files are its own to clean"
    t.allocate("a", "master", 10, torch.float32)
    t.close()
    assert not os.path.exists(t.directory) and t.ledger.bytes("nvme") == 0
    assert sorted(os.listdir(tmp_path / SWAP_DIR)) == ["rank1"]


def _tier_in_a_process(root, then):
    """A child process that opens a tier at `root`, writes one file, prints its path, then
    exits without closing (then="die") or waits for a line on stdin and closes (then="wait")."""
    import subprocess
    import sys

    code = f"""
import sys, torch
from zerokit.io import AioConfig
from zerokit.tiers import Ledger
from zerokit.tiers.nvme import NvmeTier
t = NvmeTier(Ledger(), {str(root)!r}, config=AioConfig(block_size=16384, queue_depth=4))
r = t.allocate("theirs", "master", 100, torch.float32)
print(r.path, flush=True)
if {then!r} == "die":
    import os; os._exit(0)
sys.stdin.readline()
t.close()
"""
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    path = p.stdout.readline().strip()
    assert path, "the child process did not start its tier"
    return p, path


def test_a_dead_runs_directory_is_cleaned_and_said(tmp_path):
    p, path = _tier_in_a_process(tmp_path, "die")
    p.wait()
    assert os.path.exists(path)
    t = NvmeTier(Ledger(), str(tmp_path), config=CFG)
    assert t.stale_files == [os.path.basename(path)]
    assert not os.path.exists(os.path.dirname(path)) and not os.path.exists(os.path.dirname(path) + ".lock")
    t.close()
    assert not (tmp_path / SWAP_DIR).exists()


def test_a_live_run_in_another_process_keeps_its_files(tmp_path):
    p, path = _tier_in_a_process(tmp_path, "wait")
    try:
        t = NvmeTier(Ledger(), str(tmp_path), config=CFG)
        assert t.stale_files == [] and os.path.exists(path)
        assert t.directory != os.path.dirname(path)
        t.close()
        assert os.path.exists(path), "closing one tier removed another's files"
    finally:
        p.communicate("\n", timeout=60)
    assert p.returncode == 0 and not (tmp_path / SWAP_DIR).exists()


def test_two_live_tiers_on_one_path_keep_their_own_files(tmp_path):
    # A notebook running initialize again while the old engine is referenced, or a teacher and
    # a student on one nvme_path: each tier reads back what it wrote, whichever closes first.
    first = NvmeTier(Ledger(), str(tmp_path), config=CFG)
    a = first.allocate("w", "master", 3000, torch.float32)
    first.write(a, _buf(3000).fill_(1.0)).wait()
    second = NvmeTier(Ledger(), str(tmp_path), config=CFG)
    assert second.stale_files == [] and second.directory != first.directory
    b = second.allocate("w", "master", 3000, torch.float32)
    second.write(b, _buf(3000).fill_(2.0)).wait()
    out = _buf(3000)
    first.read(a, out).wait()
    assert torch.equal(out, torch.ones(3000))
    first.close()
    second.read(b, out).wait()
    assert torch.equal(out, torch.full((3000,), 2.0))
    second.close()
    assert not (tmp_path / SWAP_DIR).exists()


def test_narrow_out_of_range():
    r = FileRange("/x", 0, 10, torch.float32, owner="o")
    assert r.narrow(2, 3).offset == 8
    with pytest.raises(ValueError, match=r"\[8, 13\)"):
        r.narrow(8, 5)


def test_gradient_writes_to_many_files_share_the_tiers_window(tier, monkeypatch):
    """The host buffers of gradient pieces in flight are bounded over every file of the tier,
    not per file: each unit's file bounded alone, a 1B model's backward held 20 windows (1.25
    GiB). Pieces of five files, none settled: the bytes in flight and the buffers the ledger
    counts as taken stay within one window; every file holds its pieces after settle."""
    from zerokit.parts import nvme as nvme_part
    from zerokit.parts.nvme import FileGradient, read_range

    piece_numel = 1024  # 4 KiB each; a window of two pieces
    monkeypatch.setattr(nvme_part, "GRAD_CHUNK_BYTES", 4096)
    monkeypatch.setattr(tier.write_window, "limit", 2 * 4096)
    files = [tier.allocate(f"u{i}/grad", "grads", 4 * piece_numel, torch.float32) for i in range(5)]
    grads = [FileGradient(tier, r) for r in files]
    g = torch.Generator().manual_seed(0)
    want = [torch.randn(4 * piece_numel, generator=g) for _ in files]
    most_taken = 0
    for grad, w in zip(grads, want):
        grad.add(w, 0)  # four chunks of one piece each
        assert tier.write_window.bytes_in_flight <= 2 * 4096
        most_taken = max(most_taken, tier.ledger.bytes(TierName.HOST, "buffers"))
    assert most_taken <= 2 * 4096, most_taken
    for grad, rng, w in zip(grads, files, want):
        grad.settle()
        assert torch.equal(read_range(tier, rng), w)
    assert tier.write_window.bytes_in_flight == 0
    assert tier.ledger.bytes(TierName.HOST, "buffers") == 0


def test_file_gradient_accumulates_zero_fills_and_norms_like_a_tensor(tier, monkeypatch):
    """[Note: gradients on NVMe]: pieces written, re-cut accumulation read-add-written, elements
    no piece reached read as zero, the norm from the pieces equal to the tensor's; a stale file
    (the last step's gradient) never leaks into the next after clear()."""
    from zerokit.parts.nvme import FileGradient, read_range

    monkeypatch.setattr(tier.write_window, "limit", 256)  # waits while adding too
    n = 1000
    rng = tier.allocate("u/grad", "grads", n, torch.float32)
    fill = _buf(n).fill_(123.0)  # the file holds a stale gradient from an earlier step
    tier.write(rng, fill).wait()
    grad = FileGradient(tier, rng)
    want = torch.zeros(n)
    g = torch.Generator().manual_seed(0)
    for lo, hi in [(0, 300), (300, 640), (700, 1000),      # a micro-step: [640, 700) never reached
                   (0, 300), (300, 640), (700, 1000),      # the same cut again: accumulation
                   (100, 800)]:                            # a re-cut over several earlier pieces
        piece = torch.randn(hi - lo, generator=g)
        grad.add(piece, lo)
        want[lo:hi] += piece
    total = grad.sq_norm()
    grad.zero_unwritten()
    got = read_range(tier, rng)
    assert torch.equal(got, want), (got - want).abs().max()
    assert total == pytest.approx(float(want.double().square().sum()), rel=1e-12)
    assert grad.sq_norm() == pytest.approx(total, rel=1e-12)
    grad.clear()
    grad.add(torch.ones(10), 500)
    grad.zero_unwritten()
    want = torch.zeros(n)
    want[500:510] = 1
    assert torch.equal(read_range(tier, rng), want)
    assert grad.sq_norm() == 10.0


def test_accumulation_reads_the_earlier_sums_ahead_in_last_rounds_order(tier, monkeypatch):
    """[Note: gradient read-ahead]: three files, two chunks each, three micro-steps over two
    steps. From the second round on, every chunk but the round's first is served by a read
    issued before its piece arrived, within the read-ahead limit; the sums equal the tensors'.
    A file cleared and written again after its chunks were read ahead sums what it holds."""
    from zerokit.parts import nvme as nvme_part
    from zerokit.parts.nvme import FileGradient, read_range

    n = 2048  # two chunks of 4 KiB per file
    monkeypatch.setattr(nvme_part, "GRAD_CHUNK_BYTES", 4096)
    tier.read_ahead.limit = 3 * 4096
    files = [tier.allocate(f"u{i}/grad", "grads", n, torch.float32) for i in range(3)]
    grads = [FileGradient(tier, r) for r in files]
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        want = [torch.zeros(n) for _ in files]
        for micro in range(3):
            before = dict(tier.read_ahead.stats)
            for i in (2, 1, 0):  # backward: the last unit first
                piece = torch.randn(n, generator=g)
                grads[i].add(piece, 0)
                want[i] += piece
                assert tier.read_ahead.bytes_ahead <= 3 * 4096
            got = {k: tier.read_ahead.stats[k] - before[k] for k in before}
            if micro == 0:
                assert got == {"ahead": 0, "now": 0}  # first writes: nothing to read
            elif (step, micro) == (0, 1):
                assert got == {"ahead": 0, "now": 6}  # no earlier round to follow
            else:
                assert got == {"ahead": 5, "now": 1}, (step, micro, got)
        for grad, rng, w in zip(grads, files, want):
            grad.settle()  # the last writes may be in flight
            assert torch.equal(read_range(tier, rng), w)
            grad.zero_unwritten()
            grad.clear()
    assert tier.read_ahead.bytes_ahead == 0
    # a file cleared and written anew after its chunks were read ahead: the reads are stale and
    # forgotten, each sum is what the file holds
    want = [torch.zeros(n), torch.zeros(n)]
    for i in (0, 1, 0, 1, 0):
        piece = torch.randn(n, generator=g)
        grads[i].add(piece, 0)
        want[i] += piece
    assert tier.read_ahead.bytes_ahead == 2 * 4096  # file 1's two chunks, read ahead
    grads[1].clear()
    want[1] = torch.zeros(n)
    for _ in range(2):
        piece = torch.randn(n, generator=g)
        grads[1].add(piece, 0)
        want[1] += piece
    for grad, rng, w in zip(grads, files, want):
        grad.settle()
        assert torch.equal(read_range(tier, rng), w)
    tier.read_ahead.drop()
    assert tier.ledger.bytes(TierName.HOST, "buffers") == 0
    # host buffers, as the plan counts them, on a CPU-only run too (this ledger's compute tier
    # is "device"): the host budget checks them, and the cache shares them with the pieces'
    assert tier.ledger.cpu_tier() is TierName.DEVICE
    assert tier.ledger.bytes(TierName.DEVICE, "buffers", peak=True) == 0
    assert tier.ledger.bytes(TierName.HOST, "buffers", peak=True) >= 2 * 4096


@pytest.mark.slow
def test_opening_while_another_rank_leaves_the_shared_directory(tmp_path):
    # A rank closing its tier removes the shared zerokit-swap directory once it is empty; a
    # rank opening its own at that moment must not fail with "No such file or directory".
    import threading

    parent = tmp_path / SWAP_DIR
    stop = threading.Event()

    def other_rank_leaving():
        while not stop.is_set():
            try:
                os.rmdir(parent)
            except OSError:
                pass

    t = threading.Thread(target=other_rank_leaving)
    t.start()
    try:
        for _ in range(40):
            NvmeTier(Ledger(), str(tmp_path), rank=0, config=CFG).close()
    finally:
        stop.set()
        t.join()


def test_a_tier_that_fails_to_start_leaves_no_directory(tmp_path):
    with pytest.raises(ValueError, match="backend"):
        NvmeTier(Ledger(), str(tmp_path), config=CFG, backend="no-such-backend")
    assert not (tmp_path / SWAP_DIR).exists()
