"""TensorSwapper: dtypes, odd sizes, prefetch, residency, byte count, threads, and failures."""
import errno
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import warnings

import pytest
import torch

from zerokit.io import AioConfig, AioError, BufferPool, ChecksumError, TensorSwapper
from fast_tier import slow_except

from _aio_backends import BACKENDS

CFG = AioConfig(block_size=16384, queue_depth=4, thread_count=1)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool]


def _make(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.fixture(params=BACKENDS)
def swapper(request, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        s = TensorSwapper(str(tmp_path), rank=3, config=CFG, checksums=True,
                          backend=request.param)
    yield s
    s.close()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (1,), (7, 15), (4099,), (3, 16384 // 3 + 5)])
def test_round_trip_every_dtype(swapper, dtype, shape):
    t = _make(shape, dtype)
    swapper.swap_out("w", t, wait=True)
    back = swapper.swap_in("w")
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back, t)
    out = torch.zeros_like(t)
    assert swapper.swap_in("w", out=out) is out and torch.equal(out, t)
    swapper.verify("w")


def test_out_with_other_alignment_and_wrong_shape(swapper):
    t = _make((50001,), torch.float32)
    swapper.swap_out("a", t, wait=True)
    raw = torch.empty(50001 * 4 + 8, dtype=torch.uint8)
    out = raw[4:4 + 50001 * 4].view(torch.float32)  # address residue differs from the file's
    swapper.swap_in("a", out=out)
    assert torch.equal(out, t)
    with pytest.raises(ValueError, match="float32"):
        swapper.swap_in("a", out=torch.empty(3, dtype=torch.float32))


def test_prefetch_residency_and_byte_count(swapper, tmp_path):
    a, b = _make((1000, 7), torch.float32), _make((33,), torch.int64, 1)
    h = swapper.swap_out("a", a)
    assert swapper.where("a") in ("writing", "nvme")
    swapper.swap_out("b", b)
    swapper.synchronize()
    assert h.done() and swapper.residency() == {"a": "nvme", "b": "nvme"}
    on_disk = sum(os.path.getsize(os.path.join(swapper.directory, f))
                  for f in os.listdir(swapper.directory))
    assert swapper.nvme_bytes == on_disk >= a.numel() * 4 + b.numel() * 8
    swapper.prefetch("a")
    assert swapper.where("a") in ("prefetching", "prefetched")
    assert torch.equal(swapper.swap_in("a"), a) and swapper.where("a") == "nvme"
    swapper.swap_out("a", b, wait=True)  # replacing a key removes its old file
    assert len(os.listdir(swapper.directory)) == 2 and torch.equal(swapper.swap_in("a"), b)
    swapper.remove("b")
    assert swapper.keys() == ["a"] and swapper.nvme_bytes == os.path.getsize(swapper.path_of("a"))
    with pytest.raises(KeyError, match="'b'"):
        swapper.swap_in("b")
    directory = swapper.directory
    assert os.path.basename(directory).startswith("rank3-")
    assert os.path.basename(os.path.dirname(directory)) == "zerokit-swap"
    swapper.close()
    assert not os.path.exists(directory) and swapper.nvme_bytes == 0


def test_pool_makes_steady_state_allocation_free(tmp_path):
    pool = BufferPool(1 << 16, 2, pin=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        s = TensorSwapper(str(tmp_path), config=CFG, pool=pool)
    ts = [_make((5000,), torch.float32, i) for i in range(4)]
    for step in range(5):
        for i, t in enumerate(ts):
            s.swap_out(f"p{i}", t + step)
        s.synchronize()
        for i in range(2):
            s.prefetch(f"p{i}")
        for i, t in enumerate(ts):
            assert torch.equal(s.swap_in(f"p{i}"), t + step)
    assert pool.allocations == 2 and pool.free_count == 2
    s.close()


def test_concurrent_swaps_from_two_threads(swapper):
    errors = []

    def worker(tid):
        try:
            for i in range(25):
                t = _make((977 + i * 131,), DTYPES[(i + tid) % len(DTYPES)], seed=tid * 100 + i)
                key = f"t{tid}.{i % 5}"
                swapper.swap_out(key, t)
                if i % 3 == 0:
                    swapper.prefetch(key)
                assert torch.equal(swapper.swap_in(key), t), key
        except Exception as e:  # surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert len(swapper.keys()) == 10 and len(os.listdir(swapper.directory)) == 10


def test_corrupted_file_is_caught_and_others_survive(swapper):
    good, bad = _make((20000,), torch.float32, 1), _make((20000,), torch.float32, 2)
    swapper.swap_out("good", good)
    swapper.swap_out("bad", bad, wait=True)
    swapper.synchronize()
    path = swapper.path_of("bad")
    with open(path, "r+b") as f:
        f.seek(40000)
        byte = f.read(1)
        f.seek(40000)
        f.write(bytes([byte[0] ^ 1]))
    for op in (swapper.verify, swapper.swap_in):
        with pytest.raises(ChecksumError) as ei:
            op("bad")
        assert path in str(ei.value) and "'bad'" in str(ei.value)
    assert torch.equal(swapper.swap_in("good"), good)


def test_missing_and_short_files_name_path_and_key(swapper):
    swapper.swap_out("gone", _make((9000,), torch.int32), wait=True)
    swapper.swap_out("short", _make((9000,), torch.int32), wait=True)
    gone, short = swapper.path_of("gone"), swapper.path_of("short")
    os.unlink(gone)
    os.truncate(short, 20000)
    with pytest.raises(AioError) as ei:
        swapper.swap_in("gone")
    assert ei.value.errno == errno.ENOENT and gone in str(ei.value) and "'gone'" in str(ei.value)
    with pytest.raises(AioError) as ei:
        swapper.swap_in("short")
    assert "short file" in str(ei.value) and short in str(ei.value) and "'short'" in str(ei.value)


def _run_child(code: str, directory: str) -> dict:
    env = dict(os.environ, ZK_DIR=directory)
    r = subprocess.run([sys.executable, "-c", code], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


CHILD_PRELUDE = """
import errno, json, os, resource, signal, sys, warnings
import torch
warnings.simplefilter("ignore")
from zerokit.io import AioConfig, AioError, TensorSwapper
backend = sys.argv[1] if len(sys.argv) > 1 else "auto"
"""


@pytest.mark.parametrize("backend", slow_except(BACKENDS, fast=BACKENDS[:1]))
def test_disk_full_is_a_clean_error_and_others_survive(tmp_path, backend):
    # RLIMIT_FSIZE makes writes past 1 MiB fail with EFBIG, as a full disk fails with ENOSPC,
    # without root or a real full disk; SIGXFSZ is ignored so the process gets the error.
    code = CHILD_PRELUDE.replace('"auto"', repr(backend)) + textwrap.dedent("""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    s = TensorSwapper(os.environ["ZK_DIR"], config=AioConfig(block_size=65536), checksums=True,
                      backend=backend)
    small = torch.arange(10000, dtype=torch.float32)
    s.swap_out("small", small, wait=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    out = {}
    for key in ("big", "small"):   # a new key, then a rewrite of an existing one
        try:
            s.swap_out(key, torch.ones(1 << 20, dtype=torch.float32), wait=True)
            out[key] = "no error"
        except AioError as e:
            out[key] = [e.errno, str(e), e.path]
    out["small_ok"] = bool(torch.equal(s.swap_in("small"), small))
    out["keys"] = s.keys()
    out["files"] = sorted(os.listdir(s.directory))
    out["nvme_bytes"] = s.nvme_bytes
    out["small_size"] = os.path.getsize(s.path_of("small"))
    s.close()
    print(json.dumps(out))
    """)
    out = _run_child(code, str(tmp_path))
    for key in ("big", "small"):
        err, msg, path = out[key]
        assert err in (errno.EFBIG, errno.ENOSPC) and path in msg and f"'{key}'" in msg
        assert "offset" in msg and os.strerror(err) in msg
    assert out["small_ok"] and out["keys"] == ["small"] and len(out["files"]) == 1
    assert out["nvme_bytes"] == out["small_size"]


@pytest.mark.skipif(not hasattr(os, "setuid"), reason="needs POSIX users")
def test_permission_denied_names_path_and_key():
    # Permission bits do not bind root, so the child drops to 'nobody' once the files exist.
    base = tempfile.mkdtemp()
    os.chmod(base, 0o755)
    try:
        code = CHILD_PRELUDE + textwrap.dedent("""
        s = TensorSwapper(os.environ["ZK_DIR"], backend="python")
        s.swap_out("a", torch.arange(100), wait=True)
        os.chmod(s.directory, 0o555)
        os.chmod(s.path_of("a"), 0o000)
        if os.geteuid() == 0:
            os.setgid(65534); os.setuid(65534)
        out = {}
        for name, op in (("read", lambda: s.swap_in("a")),
                         ("write", lambda: s.swap_out("b", torch.ones(10), wait=True))):
            try:
                op()
                out[name] = "no error"
            except AioError as e:
                out[name] = [e.errno, str(e)]
        print(json.dumps(out))
        """)
        out = _run_child(code, base)
        assert out["read"][0] == errno.EACCES and "'a'" in out["read"][1]
        assert out["write"][0] == errno.EACCES and "'b'" in out["write"][1]
        assert os.path.join(base, "zerokit-swap", "rank0-") in out["read"][1]
    finally:
        subprocess.run(["chmod", "-R", "u+rwx", base], check=False)
        subprocess.run(["rm", "-rf", base], check=False)


# -- streaming through a ring of staging buffers (the NVMe -> host -> device path) ------------
def _pieces(swapper, key):
    """stream_in's pieces, copied (each is a staging view, reused after the next one)."""
    return [(start, piece.clone()) for start, piece in swapper.stream_in(key)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
@pytest.mark.parametrize("numel", [1, 4095, 16384 * 5 + 17])
def test_stream_in_pieces_are_the_tensor_in_order(swapper, dtype, numel):
    t = _make((numel,), dtype)
    # An ordinary tensor sits at 64 mod 4096: the file's first piece then starts mid-block.
    swapper.swap_out("s", t, wait=True)
    pieces = _pieces(swapper, "s")
    starts = [s for s, _ in pieces]
    assert starts[0] == 0 and starts == sorted(starts)
    assert all(s + p.numel() == n for (s, p), (n, _) in zip(pieces, pieces[1:]))
    assert torch.equal(torch.cat([p for _, p in pieces]), t)
    ring = swapper._staging_ring()
    assert ring.free_count == ring.capacity
    assert ring.capacity * ring.buffer_bytes == CFG.block_size * CFG.queue_depth
    # Host memory is the ring's, not the tensor's: one piece per ring buffer's worth of file.
    pad, chunk = t.data_ptr() % 4096, ring.buffer_bytes
    assert len(pieces) == (pad + t.numel() * t.element_size() - 1) // chunk - pad // chunk + 1


def test_stream_in_uses_the_pool_and_allocates_nothing_more(tmp_path):
    pool = BufferPool(2 * CFG.block_size + 100, 3, pin=False)  # two blocks per piece
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        s = TensorSwapper(str(tmp_path), config=CFG, checksums=True, pool=pool)
    t = _make((16384 * 7 + 5,), torch.float32)
    s.swap_out("big", t, wait=True)
    held = pool.acquire()  # a pool shared with other users: the ring is shallower, not stuck
    for _ in range(3):
        pieces = _pieces(s, "big")
        assert torch.equal(torch.cat([p for _, p in pieces]), t)
        assert max(p.numel() for _, p in pieces) * 4 <= 2 * CFG.block_size
    pool.release(held)
    assert pool.allocations == 3 and pool.free_count == 3 and s._ring is None
    s.close()


def test_stream_in_corruption_and_early_exit_give_every_buffer_back(swapper):
    t = _make((16384 * 6,), torch.float32)
    swapper.swap_out("c", t, wait=True)
    # Leaving the loop early drains the reads in flight and returns their buffers.
    first = next(iter(swapper.stream_in("c")))
    assert first[0] == 0
    ring = swapper._staging_ring()
    it = swapper.stream_in("c")
    next(it)
    it.close()
    assert ring.free_count == ring.capacity
    path = swapper.path_of("c")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 20000)
        f.write(b"\xff" * 8)
    with pytest.raises(ChecksumError, match="'c'"):
        _pieces(swapper, "c")
    assert ring.free_count == ring.capacity


def test_stream_needs_buffers_of_a_block(tmp_path):
    from zerokit.io.stream import read_chunks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        s = TensorSwapper(str(tmp_path), config=CFG, pool=BufferPool(4096, 2, pin=False))
    s.swap_out("x", torch.ones(10000), wait=True)
    # A pool too small for a block is not used as the ring: the swapper makes its own.
    assert torch.equal(s.swap_in("x"), torch.ones(10000))
    assert torch.equal(torch.cat([p for _, p in _pieces(s, "x")]), torch.ones(10000))
    with pytest.raises(ValueError, match="buffer_bytes=4096"):
        next(read_chunks(s.aio, s.path_of("x"), 40000, BufferPool(4096, 2, pin=False)))
    s.close()


# A device tensor goes out through the ring (swap_out -> _swap_out_streamed). CI has no GPU, so
# the same path runs here with CPU tensors; only the device -> host copy differs.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
@pytest.mark.parametrize("numel", [0, 1, 4095, 16384 * 5 + 17])
def test_streamed_swap_out_round_trips(swapper, dtype, numel):
    t = _make((numel,), dtype, seed=numel)
    h = swapper._swap_out_streamed("d", t)
    assert h.done() and h.wait() == t.numel() * t.element_size()
    assert swapper.where("d") == "nvme"
    assert os.path.getsize(swapper.path_of("d")) == t.numel() * t.element_size()
    assert torch.equal(swapper.swap_in("d"), t)
    assert torch.equal(torch.cat([p for _, p in _pieces(swapper, "d")] or [t[:0]]), t)
    if numel:
        swapper.verify("d")  # per-block checksums of the pieces, joined, cover the whole file
    ring = swapper._staging_ring()
    assert ring.free_count == ring.capacity


def test_streamed_swap_out_failure_keeps_the_previous_version(swapper, monkeypatch):
    old, new = _make((16384 * 6,), torch.float32, 1), _make((16384 * 6,), torch.float32, 2)
    swapper._swap_out_streamed("k", old)
    write, calls = swapper.aio.write, []

    def failing(path, *a, **k):
        calls.append(path)
        if len(calls) == 3:  # the third piece: two are on disk or in flight
            raise AioError(errno.ENOSPC, "writing", path, offset=0)
        return write(path, *a, **k)

    monkeypatch.setattr(swapper.aio, "write", failing)
    with pytest.raises(AioError, match="'k'.*No space left"):
        swapper._swap_out_streamed("k", new)
    monkeypatch.setattr(swapper.aio, "write", write)
    assert torch.equal(swapper.swap_in("k"), old)
    assert len(os.listdir(swapper.directory)) == 1  # the new file is gone
    ring = swapper._staging_ring()
    assert ring.free_count == ring.capacity


def test_two_swappers_on_one_directory_keep_their_own_files(tmp_path):
    first = TensorSwapper(str(tmp_path), backend="python")
    second = TensorSwapper(str(tmp_path), backend="python")
    first.swap_out("k", torch.ones(1000), wait=True)
    second.swap_out("k", torch.full((1000,), 2.0), wait=True)
    first.close()
    assert torch.equal(second.swap_in("k"), torch.full((1000,), 2.0))
    second.close()
    assert os.listdir(tmp_path) == []


# -- the swapper as a layer on its nvme tier, each key version through SwapState ---------------
def test_a_version_moves_through_its_table_and_refuses_an_illegal_move(swapper):
    from zerokit.states import IllegalTransition, SwapState

    t = _make((5000,), torch.float32)
    swapper.swap_out("k", t, wait=True)
    version = swapper._entries["k"]
    with pytest.raises(IllegalTransition, match="swapped tensor 'k': illegal state change "
                                                "'nvme' -> 'prefetched'"):
        version.move(SwapState.PREFETCHED, "k")  # a read that was never started
    assert swapper.where("k") == "nvme"
    swapper.prefetch("k")
    version.prefetch[1].wait()
    assert swapper.where("k") == "prefetched"
    with pytest.raises(IllegalTransition, match="'prefetched' -> 'prefetching'"):
        version.move(SwapState.PREFETCHING, "k")  # a second read over the one held
    assert torch.equal(swapper.swap_in("k"), t) and swapper.where("k") == "nvme"
    # One place does the I/O and counts it: the swapper's tier (its stats, its ledger).
    stats = swapper.tier.stats
    assert stats.total_written == t.nbytes and stats.total_read == t.nbytes  # swap_in took the prefetch
    assert swapper.nvme_bytes == swapper.tier.ledger.bytes("nvme", "buffers") == os.path.getsize(
        swapper.path_of("k"))
    assert swapper.tier.owners() == [version.file.owner]
