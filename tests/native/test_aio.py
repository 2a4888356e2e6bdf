"""The async I/O engine, native and pure-Python: round trips, edges, errors, buffers."""
import errno
import os
import warnings
import zlib

import pytest
import torch

from zerokit.io import aio as aio_mod
from zerokit.io import AioConfig, AioError, AsyncIO, BufferPool, ChecksumError, aligned_empty
from zerokit.io import native_available

from _aio_backends import BACKENDS, NATIVE_BACKENDS

BS = 16384  # small blocks so a few KiB already span several blocks
CFG = AioConfig(block_size=BS, queue_depth=4, thread_count=2)


@pytest.fixture(params=BACKENDS)
def aio(request):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        a = AsyncIO(CFG, backend=request.param)
    yield a
    a.close()


def _rand(n, skew=0):
    """n random bytes whose address is `skew` past a 4096 boundary."""
    t = aligned_empty(n, residue=skew)
    t.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    return t


@pytest.mark.parametrize("n", [0, 1, 511, 4095, 4096, 4097, BS - 1, BS + 1, 3 * BS + 77])
@pytest.mark.parametrize("skew", [0, 64, 1])
def test_round_trip_sizes_and_alignment(aio, tmp_path, n, skew):
    src = _rand(n, skew)
    path = str(tmp_path / "f")
    for off in (0, skew, 4096 + 3):
        h = aio.write(path, src, off, checksums=True)
        assert h.wait() == n
        assert os.path.getsize(path) >= (off + n if n else 0)
        dst = _rand(n, (skew + 7) % 4096)  # another residue: exercises staging on read
        assert aio.read(path, dst, off, expected_checksums=h.checksums).wait() == n
        assert torch.equal(dst, src), (n, skew, off)
        os.unlink(path)


def test_file_size_is_exact_after_direct_write(aio, tmp_path):
    path = str(tmp_path / "f")
    aio.write(path, _rand(5000, 64), 64).wait()
    assert os.path.getsize(path) == 5064  # the sector padding of O_DIRECT is cut back


def test_unaligned_write_keeps_neighbouring_bytes(aio, tmp_path):
    path = str(tmp_path / "f")
    base = _rand(3 * BS)
    aio.write(path, base).wait()
    patch = _rand(5000, 3)
    aio.write(path, patch, 4100).wait()
    expect = base.clone()
    expect[4100:9100] = patch
    got = torch.empty(3 * BS, dtype=torch.uint8)
    aio.read(path, got).wait()
    assert torch.equal(got, expect)


def test_handles_are_async_and_idempotent(aio, tmp_path):
    srcs = [_rand(2 * BS + i, i) for i in range(8)]
    hs = [aio.write(str(tmp_path / f"f{i}"), s, fsync=(i == 0)) for i, s in enumerate(srcs)]
    assert [h.wait() for h in hs] == [s.numel() for s in srcs]
    assert all(h.done() for h in hs) and hs[0].wait() == srcs[0].numel()
    outs = [torch.empty_like(s) for s in srcs]
    rs = [aio.read(str(tmp_path / f"f{i}"), o) for i, o in enumerate(outs)]
    aio.synchronize()
    assert all(r.done() for r in rs)
    for s, o in zip(srcs, outs):
        assert torch.equal(s, o)


def test_missing_file_names_path(aio, tmp_path):
    path = str(tmp_path / "nope")
    with pytest.raises(AioError) as ei:
        aio.read(path, torch.empty(10, dtype=torch.uint8))
    assert ei.value.errno == errno.ENOENT and path in str(ei.value)


def test_short_file_is_an_error_not_garbage(aio, tmp_path):
    path = str(tmp_path / "f")
    aio.write(path, _rand(2 * BS + 100)).wait()
    os.truncate(path, BS + 10)
    with pytest.raises(AioError) as ei:
        aio.read(path, torch.empty(2 * BS + 100, dtype=torch.uint8)).wait()
    msg = str(ei.value)
    assert "short file" in msg and path in msg and f"offset {BS}" in msg


def test_short_file_names_the_first_short_block_whatever_finishes_first(aio, tmp_path):
    # Blocks past the end are short too, and one may finish first: an unaligned tail runs on
    # the thread pool while aligned blocks wait for the kernel's queue. The report must still
    # name the first short block, so blocks before a failure must run, not be skipped.
    path = str(tmp_path / "f")
    n = 48 * BS + 100
    aio.write(path, _rand(n)).wait()
    os.truncate(path, 40 * BS + 10)
    for _ in range(10):
        with pytest.raises(AioError) as ei:
            aio.read(path, aligned_empty(n)).wait()
        assert ei.value.offset == 40 * BS, str(ei.value)


def test_corrupted_block_fails_checksum(aio, tmp_path):
    path = str(tmp_path / "f")
    src = _rand(3 * BS)
    h = aio.write(path, src, checksums=True)
    h.wait()
    assert len(h.checksums) == 3
    with open(path, "r+b") as f:
        f.seek(2 * BS + 5)
        b = f.read(1)
        f.seek(2 * BS + 5)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(ChecksumError) as ei:
        aio.read(path, torch.empty(3 * BS, dtype=torch.uint8), expected_checksums=h.checksums).wait()
    assert ei.value.offset == 2 * BS and path in str(ei.value)


def test_checksum_algorithms_match_references(aio, tmp_path):
    data = bytes(range(256)) * 60  # one block
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    h = aio.write(str(tmp_path / "f"), src, checksums=True)
    h.wait()
    if aio.checksum_algorithm == "crc32":
        assert h.checksums == [zlib.crc32(data)]
    else:
        from zerokit.io import _aio
        assert _aio.crc32c(torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)
                           .data_ptr(), 9) == 0xE3069283  # the standard check value
        assert h.checksums == [_aio.crc32c(src.data_ptr(), len(data))]


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
def test_native_uses_o_direct_where_the_filesystem_allows(tmp_path, backend):
    probe = str(tmp_path / "probe")
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT))
        expected = True
    except OSError:
        expected = False
    with AsyncIO(CFG, backend=backend) as a:
        h = a.write(str(tmp_path / "f"), _rand(BS))
        h.wait()
        assert h.direct is expected
        # One aligned block of an O_DIRECT file: the kernel takes it under linux-aio.
        kernel = 1 if expected and backend == "linux-aio" else 0
        assert a.block_counts() == {"kernel": kernel, "threads": 1 - kernel}


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
def test_o_direct_refused_falls_back_to_buffered_with_one_warning(tmp_path, monkeypatch, backend):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(aio_mod.os, "open", no_direct)
    aio_mod._warned.clear()
    with AsyncIO(CFG, backend=backend) as a, warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for i in range(3):
            src = _rand(BS + 9, 64)
            h = a.write(str(tmp_path / f"f{i}"), src)
            h.wait()
            assert not h.direct
            dst = torch.empty_like(src)
            a.read(str(tmp_path / f"f{i}"), dst).wait()
            assert torch.equal(dst, src)
        assert a.block_counts()["kernel"] == 0  # buffered files never go to kernel AIO
    assert sum("O_DIRECT refused" in str(x.message) for x in w) == 1


def test_config_matches_deepspeed_keys():
    c = AioConfig.from_dict({"block_size": 8 << 20, "queue_depth": 16, "thread_count": 2,
                             "single_submit": True, "overlap_events": False})
    assert (c.block_size, c.queue_depth, c.thread_count) == (8 << 20, 16, 2)
    with pytest.raises(ValueError, match="queue_depth"):
        AioConfig.from_dict({"queue_dept": 4})
    with pytest.raises(ValueError, match="4096"):
        AioConfig(block_size=1000)


def test_aligned_buffers_and_pool_reuse():
    for residue in (0, 64, 4095):
        t = aligned_empty(10000, residue=residue)
        assert t.data_ptr() % 4096 == residue and t.numel() == 10000
    pool = BufferPool(BS, 2, pin=False)
    bufs = [pool.acquire(BS - 3, residue=64) for _ in range(2)]
    assert all(b.data_ptr() % 4096 == 64 and b.numel() == BS - 3 for b in bufs)
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.01)
    for b in bufs:
        pool.release(b)
    for _ in range(50):
        with pool.lease() as b:
            assert b.numel() == BS
    assert pool.allocations == 2 and pool.free_count == 2
    with pytest.raises(ValueError, match="exceeds"):
        pool.acquire(BS + 1)
    with pytest.raises(ValueError, match="not a buffer"):
        pool.release(torch.empty(4, dtype=torch.uint8))


def test_native_engine_is_built_where_a_compiler_exists():
    """The native-only skips above must never hide a failed build of the extension."""
    import shutil

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the Python engine is the expected path")
    assert native_available(), "a C++ compiler exists but zerokit.io._aio was not built"


def test_large_buffers_start_on_huge_pages_and_ask_for_them(tmp_path):
    from zerokit.io import huge_pages

    big = aligned_empty(huge_pages.MIN_BYTES + 5, residue=64)
    assert big.data_ptr() % huge_pages.HUGE_PAGE == 64  # the residue, on a 2 MiB boundary
    small = aligned_empty(huge_pages.MIN_BYTES - 4096, residue=64)
    assert small.data_ptr() % 4096 == 64 and small.numel() == huge_pages.MIN_BYTES - 4096
    fresh = torch.empty(3 * huge_pages.HUGE_PAGE, dtype=torch.uint8)
    advised = huge_pages.advise(fresh.data_ptr(), fresh.numel())
    if huge_pages.thp_mode() in ("always", "madvise"):
        assert advised >= huge_pages.HUGE_PAGE and advised % huge_pages.HUGE_PAGE == 0
    else:
        assert advised == 0
    assert huge_pages.advise(fresh.data_ptr(), 4096) == 0  # no whole huge page inside
    with AsyncIO(CFG) as a:  # a huge-page buffer round-trips like any other
        big.copy_(torch.randint(0, 256, (big.numel(),), dtype=torch.uint8))
        a.write(str(tmp_path / "f"), big, 64).wait()
        back = aligned_empty(big.numel(), residue=64)
        a.read(str(tmp_path / "f"), back, 64).wait()
        assert torch.equal(back, big)


def _until_done(*handles, timeout=10.0):
    """Spins until the engine has moved every handle's bytes, without completing the handles
    (no wait(): that would run the completion step under test)."""
    import time

    deadline = time.monotonic() + timeout
    while not all(h.done() for h in handles):
        assert time.monotonic() < deadline, "I/O did not finish"
        time.sleep(0.001)


@pytest.mark.parametrize("engines", [1, 2], ids=["one-engine", "two-engines"])
@pytest.mark.parametrize("b_off,b_len", [(1000, 3000), (1000, 9000), (12288 + 100, 5000)],
                         ids=["adjacent", "adjacent-long", "further-out"])
def test_concurrent_extending_writes_keep_each_others_bytes(aio, tmp_path, b_off, b_len,
                                                            engines):
    """Two live writes extending one file: completing the first (cutting O_DIRECT's sector
    padding) must not truncate away what the second wrote, whichever backend moved the bytes
    and whether one engine or two submitted them."""
    path = str(tmp_path / "f")
    a, b = _rand(1000, 64), _rand(b_len, 3)
    ha = aio.write(path, a, 0)
    _until_done(ha)  # A's bytes (and padding) are on disk, its completion still pending
    other = AsyncIO(aio.config, backend=aio.backend.replace("python-threads", "python")) \
        if engines == 2 else aio
    hb = other.write(path, b, b_off)
    _until_done(hb)  # B's bytes too: both handles are live, neither completed
    assert ha.wait() == 1000  # A completes first, B is still live
    assert hb.wait() == b_len
    end = b_off + b_len
    assert os.path.getsize(path) == end  # B's end, and no sector padding left behind
    expect = torch.zeros(end, dtype=torch.uint8)
    expect[:1000], expect[b_off:] = a, b
    got = torch.empty(end, dtype=torch.uint8)
    aio.read(path, got).wait()
    assert torch.equal(got, expect)
    assert not aio_mod._LIVE_WRITES.files  # the last live write of the file dropped its entry
    if other is not aio:
        other.close()


@pytest.mark.parametrize("engines", [1, 2], ids=["one-engine", "two-engines"])
@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
def test_concurrent_writes_sharing_edge_sectors_keep_every_byte(tmp_path, backend, engines):
    """Requests whose unaligned edges share a sector are written by read-modify-write of that
    sector on the pool threads; at once, one request's rewrite must not undo another's bytes.
    Many rounds of many small requests tiling one O_DIRECT file, every boundary mid-sector,
    from one engine or alternately from two (the sector locks are process-wide)."""
    sectors, rounds = 16, 40
    size = sectors * 4096
    path = str(tmp_path / "f")
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        a, b = (AsyncIO(CFG, backend=backend) for _ in range(2))
    with a, b:
        a.write(path, torch.zeros(size, dtype=torch.uint8)).wait()  # no write extends the file
        got = aligned_empty(size)
        for r in range(rounds):
            src = aligned_empty(size, residue=64 * (r % 3))
            src.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen))
            # Three cuts inside every sector, none on a sector boundary: each sector is the
            # edge of three or four requests.
            cuts = 4096 * (torch.arange(3 * sectors) // 3) \
                + torch.randint(1, 4096, (3 * sectors,), generator=gen)
            bounds = [0] + sorted(set(int(c) for c in cuts)) + [size]
            hs = [(a, b)[i % engines].write(path, src[lo:hi], lo)
                  for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
            for h in hs:
                h.wait()
            a.read(path, got).wait()
            if not torch.equal(got, src):
                bad = (got != src).nonzero().flatten()
                pytest.fail(f"round {r}: {bad.numel()} bytes lost, the first at offset "
                            f"{int(bad[0])}")
        assert os.path.getsize(path) == size


@pytest.mark.parametrize("bad_block", [0, 5, 19])
def test_a_failed_block_of_a_long_request_fails_it_without_hanging(aio, tmp_path, bad_block):
    """The blocks after a failure skip their I/O. Under linux-aio they used to take no slot and
    leave nothing in flight to wake the submitter, so a request of more blocks than the queue
    depth whose early block failed never finished (found by a test of streamed checksums)."""
    import threading

    n = 20 * BS + 68  # 21 blocks, 8 in flight at most
    path = str(tmp_path / "f")
    h = aio.write(path, _rand(n), 0, checksums=True)
    h.wait()
    bad = [c ^ 1 if i == bad_block else c for i, c in enumerate(h.checksums)]
    result = []

    def read():
        try:
            aio.read(path, aligned_empty(n), 0, expected_checksums=bad).wait()
            result.append(None)
        except ChecksumError as e:
            result.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=20)
    assert not reader.is_alive(), "the read never finished"
    assert isinstance(result[0], ChecksumError) and result[0].offset == bad_block * BS
