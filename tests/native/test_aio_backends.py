"""The native engine's backend choice and its kernel-AIO path: which blocks take which path,
the fallback when the kernel refuses an AIO context, partial completions, submission errors and
draining on destruction. Round trips and error reports of every backend are in test_aio.py and
test_swapper.py, which run each test on linux-aio, psync-threads and python."""
import errno
import os
import threading
import warnings

import pytest
import torch

from zerokit.io import aio as aio_mod
from zerokit.io import AioConfig, AioError, AsyncIO, aligned_empty, native_available

from _aio_backends import kernel_grants_aio, requires_linux_aio

pytestmark = pytest.mark.skipif(not native_available(), reason="zerokit.io._aio not built")
BS = 16384
CFG = AioConfig(block_size=BS, queue_depth=4, thread_count=2)


def _o_direct_ok(directory) -> bool:
    probe = os.path.join(directory, "probe")
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


@pytest.fixture
def direct_dir(tmp_path):
    if not _o_direct_ok(str(tmp_path)):
        pytest.skip(f"{tmp_path} refuses O_DIRECT (tmpfs?): kernel AIO is never used there")
    return tmp_path


def _rand(n, residue=0):
    t = aligned_empty(n, residue=residue)
    t.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    return t


def test_auto_picks_linux_aio_where_the_kernel_grants_it():
    grants = kernel_grants_aio()
    if grants is None:
        pytest.skip("no io_setup syscall number known for this architecture")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with AsyncIO(CFG) as a:
            assert a.backend == ("linux-aio" if grants else "psync-threads")
            assert a._engine.threads == (1 if grants else 0)  # the pool starts on first use


def test_refused_kernel_aio_falls_back_once_with_the_reason():
    # A context deeper than fs.aio-max-nr is refused (EAGAIN), as under a seccomp filter or a
    # kernel without AIO: the same path in the engine.
    try:
        with open("/proc/sys/fs/aio-max-nr") as f:
            too_deep = AioConfig(queue_depth=int(f.read()) + 1)
    except FileNotFoundError:  # a kernel without AIO refuses any depth
        too_deep = CFG
    aio_mod._warned.discard("no-kernel-aio")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(2):
            a = AsyncIO(too_deep)
            assert a.backend == "psync-threads" and a._engine.threads == 0
            a.close()
    said = [str(x.message) for x in w if "kernel AIO unavailable" in str(x.message)]
    assert len(said) == 1 and "io_setup" in said[0] and "psync-threads" in said[0]
    with pytest.raises(RuntimeError, match=r"linux-aio.*io_setup.*backend='auto'"):
        AsyncIO(too_deep, backend="linux-aio")
    with pytest.raises(ValueError, match="backend must be one of"):
        AsyncIO(CFG, backend="io_uring")


@requires_linux_aio
@pytest.mark.parametrize("residue", [0, 64])
def test_aligned_blocks_go_to_the_kernel_and_unaligned_edges_to_the_pool(direct_dir, residue):
    n = 6 * BS + 100
    src = _rand(n, residue)
    path = str(direct_dir / "f")
    with AsyncIO(CFG, backend="linux-aio") as a:
        h = a.write(path, src, offset=residue, checksums=True)
        assert h.wait() == n and h.direct
        blocks = a.num_blocks(n, residue)
        # Same residue in memory and file: only the first block (with residue) and the last
        # (partial sector) are staged.
        edges = 2 if residue else 1
        assert a.block_counts() == {"kernel": blocks - edges, "threads": edges}
        dst = _rand(n, residue)
        assert a.read(path, dst, offset=residue, expected_checksums=h.checksums).wait() == n
        assert torch.equal(dst, src)
        assert a.block_counts() == {"kernel": 2 * (blocks - edges), "threads": 2 * edges}


@requires_linux_aio
def test_more_requests_than_queue_depth_from_two_threads(direct_dir):
    srcs = [_rand(5 * BS) for _ in range(12)]
    outs = [aligned_empty(5 * BS).zero_() for _ in srcs]
    moved = []
    with AsyncIO(CFG, backend="linux-aio") as a:
        def writer(idx):
            hs = [a.write(str(direct_dir / f"f{i}"), srcs[i], checksums=True) for i in idx]
            for i, h in zip(idx, hs):
                moved.append(h.wait())
                moved.append(a.read(str(direct_dir / f"f{i}"), outs[i],
                                    expected_checksums=h.checksums).wait())

        threads = [threading.Thread(target=writer, args=(range(k, 12, 2),)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert a.block_counts() == {"kernel": 2 * 12 * 5, "threads": 0}
    assert moved == [5 * BS] * 24
    for s, o in zip(srcs, outs):
        assert torch.equal(s, o)


@requires_linux_aio
@pytest.mark.parametrize("cut", [4096, 10])  # the kernel returns a partial block: aligned or not
def test_partial_kernel_read_at_end_of_file_is_a_short_file_error(direct_dir, cut):
    path = str(direct_dir / "f")
    with AsyncIO(CFG, backend="linux-aio") as a:
        a.write(path, _rand(3 * BS)).wait()
        os.truncate(path, BS + cut)
        with pytest.raises(AioError) as ei:
            a.read(path, aligned_empty(3 * BS)).wait()
    msg = str(ei.value)
    assert "short file" in msg and path in msg and f"offset {BS}" in msg
    assert f"has {cut} bytes" in msg


@requires_linux_aio
def test_kernel_submission_error_fails_the_request_not_the_engine(direct_dir):
    from zerokit.io import _aio

    e = _aio.Engine(BS, 4, 1, False, True, backend="linux-aio")
    buf = _rand(2 * BS)
    fd = os.open(str(direct_dir / "f"), os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    os.close(fd)  # io_submit refuses the stale descriptor: EBADF for the first block
    err, off, _, nbytes, _ = e.wait(e.submit(True, fd, True, buf.data_ptr(), 2 * BS, 0))
    assert (err, off, nbytes) == (errno.EBADF, 0, 0)
    fd = os.open(str(direct_dir / "f"), os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    try:  # the engine still works
        assert e.wait(e.submit(True, fd, True, buf.data_ptr(), 2 * BS, 0))[:4] == (0, -1, 0, 2 * BS)
    finally:
        os.close(fd)
    assert e.kernel_blocks == 4 and e.pool_blocks == 0


@requires_linux_aio
def test_destroying_the_engine_completes_queued_kernel_blocks(direct_dir):
    from zerokit.io import _aio

    e = _aio.Engine(BS, 2, 1, False, True, backend="linux-aio")
    src = _rand(40 * BS)
    path = str(direct_dir / "f")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    try:
        e.submit(True, fd, True, src.data_ptr(), 40 * BS, 0)  # 40 blocks, 2 in flight
        del e  # must finish all 40 before the file and the buffer may go
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        assert f.read() == src.numpy().tobytes()
