"""NVMe offload throughput: zerokit's async I/O engine vs fio (the raw disk), torch.save/load and
DeepSpeed's async I/O op, at the same block size and queue depth; plus how much a compute loop on
the other core slows down while the engine streams.

    flock /tmp/zk-heavy.lock .venv/bin/python benchmarks/bench_nvme.py [--size-gib 2] [--dir D]

Prints a table and writes benchmarks/results/bench_nvme.json. Reads follow a page-cache drop
(root) so they come from the disk; where the drop is refused the table says so. Run it alone on
the machine: it measures the disk.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings

import torch

from zerokit.io import AioConfig, AsyncIO, TensorSwapper, aligned_empty, native_available

GiB = 1 << 30


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def fresh_or_overwrite(path: str, count: list[int]) -> None:
    """Alternates writing a new file and overwriting the last one, as the fio row does: every
    row reports its best of both, so none is favoured by extent allocation or its absence."""
    if count[0] % 2 == 0 and os.path.exists(path):
        os.unlink(path)
    count[0] += 1


def best_of(reps: int, write, read, nbytes: int) -> tuple[float, float]:
    """Best write and read GB/s over reps; the cache is dropped before every read."""
    w = r = 0.0
    for _ in range(2 * reps):
        w = max(w, nbytes / timed(write) / 1e9)
        drop_caches()
        r = max(r, nbytes / timed(read) / 1e9)
    return w, r


def bench_zerokit(cfg: AioConfig, path: str, nbytes: int, reps: int, ordinary: bool):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        aio = AsyncIO(cfg, backend="native" if native_available() else "python")
    if ordinary:  # an ordinary torch tensor: the file offset matches its address residue
        buf = torch.empty(nbytes, dtype=torch.uint8)
    else:
        buf = aligned_empty(nbytes)
    buf.fill_(7)
    off = buf.data_ptr() % 4096

    reps_done = [0]

    def write():
        fresh_or_overwrite(path, reps_done)
        aio.write(path, buf, off, fsync=True).wait()

    res = best_of(reps, write, lambda: aio.read(path, buf, off).wait(), nbytes)
    aio.close()
    return res


def bench_fio(cfg: AioConfig, path: str, nbytes: int, reps: int):
    if shutil.which("fio") is None:
        return None
    common = ["fio", "--output-format=json", "--name=zk", f"--filename={path}", "--direct=1",
              "--ioengine=libaio", f"--bs={cfg.block_size}",
              f"--iodepth={cfg.queue_depth * cfg.thread_count}", f"--size={nbytes}",
              "--numjobs=1"]
    out = {}
    for rw in ("write", "read"):
        best = 0.0
        for rep in range(2 * reps):
            if rw == "read":
                drop_caches()
            elif rep % 2 == 0 and os.path.exists(path):
                os.unlink(path)  # fio's best of a fresh file and an overwrite
            extra = ["--end_fsync=1"] if rw == "write" else []
            p = subprocess.run(common + [f"--rw={rw}"] + extra, capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"fio failed: {p.stderr}")
            job = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0][rw]
            best = max(best, job["bw_bytes"] / 1e9)
        out[rw] = best
    return out["write"], out["read"]


def bench_torch_save(path: str, nbytes: int, reps: int):
    t = torch.full((nbytes,), 7, dtype=torch.uint8)

    def write():
        with open(path, "wb") as f:
            torch.save(t, f)
            f.flush()
            os.fsync(f.fileno())  # as durable as the others

    return best_of(reps, write, lambda: torch.load(path, mmap=False), nbytes)


def bench_deepspeed(cfg: AioConfig, path: str, nbytes: int, reps: int):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from deepspeed.ops.op_builder import AsyncIOBuilder
            ops = AsyncIOBuilder().load(verbose=False)
    except Exception as e:  # not installed, or libaio-dev missing for its JIT build
        return f"not installed ({type(e).__name__})"
    h = ops.aio_handle(cfg.block_size, cfg.queue_depth, cfg.single_submit, cfg.overlap_events,
                       cfg.thread_count)
    buf = h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    buf.fill_(7)

    reps_done = [0]

    def write():
        fresh_or_overwrite(path, reps_done)
        h.async_pwrite(buf, path)
        h.wait()
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def read():
        h.async_pread(buf, path)
        h.wait()

    res = best_of(reps, write, read, nbytes)
    h.free_cpu_locked_tensor(buf)
    return res


def compute_slowdown(cfg: AioConfig, directory: str, nbytes: int) -> dict:
    """Times a fixed 1-thread matmul loop alone, then while the engine streams writes and reads
    of nbytes in a loop on another thread."""
    torch.set_num_threads(1)
    a = torch.randn(384, 384)

    def loop():
        x = a
        for _ in range(1500):
            x = torch.tanh(x @ a)
        return x

    loop()
    alone = min(timed(loop) for _ in range(3))
    stop = threading.Event()
    moved = [0]
    swapper = TensorSwapper(directory, rank=99, config=cfg)
    data = torch.full((nbytes // 4,), 1.0)

    def io():
        while not stop.is_set():
            swapper.swap_out("x", data, wait=True)  # O_DIRECT: the read below is from disk
            swapper.swap_in("x", out=data)
            moved[0] += 2 * nbytes

    th = threading.Thread(target=io)
    th.start()
    time.sleep(0.5)  # I/O already at full speed when the timing starts
    t0 = time.perf_counter()
    busy = timed(loop)
    io_gbps = moved[0] / (time.perf_counter() - t0 + 0.5) / 1e9
    stop.set()
    th.join()
    swapper.close()
    return {"alone_s": alone, "with_io_s": busy, "slowdown_pct": 100 * (busy / alone - 1),
            "io_GBps_during": io_gbps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(__file__), "..", ".bench_nvme"))
    ap.add_argument("--block-size", type=int, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--thread-count", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--skip", nargs="*", default=[], help="rows to skip: fio torch deepspeed")
    args = ap.parse_args()
    nbytes = int(args.size_gib * GiB)
    cfg = AioConfig(block_size=args.block_size, queue_depth=args.queue_depth,
                    thread_count=args.thread_count)
    d = os.path.abspath(args.dir)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "bench.bin")
    cache_dropped = drop_caches()
    rows: dict[str, object] = {}
    try:
        rows["zerokit aio (aligned buffer)"] = bench_zerokit(cfg, path, nbytes, args.reps, False)
        rows["zerokit aio (ordinary tensor)"] = bench_zerokit(cfg, path, nbytes, args.reps, True)
        if "fio" not in args.skip:
            rows["fio libaio O_DIRECT (raw disk)"] = bench_fio(cfg, path, nbytes, args.reps) \
                or "not installed"
        if "torch" not in args.skip:
            rows["torch.save / torch.load"] = bench_torch_save(path, nbytes, args.reps)
        if "deepspeed" not in args.skip:
            rows["deepspeed AsyncIOBuilder aio"] = bench_deepspeed(cfg, path, nbytes, args.reps)
        slow = compute_slowdown(cfg, d, min(nbytes, GiB // 2))
    finally:
        shutil.rmtree(d, ignore_errors=True)

    print(f"\nNVMe I/O, {nbytes / GiB:.2f} GiB, block {cfg.block_size >> 10} KiB, queue depth "
          f"{cfg.queue_depth} x {cfg.thread_count} thread(s), backend "
          f"{'native' if native_available() else 'python'}, page cache dropped before reads: "
          f"{'yes' if cache_dropped else 'NO (not root): reads may hit the cache'}")
    print(f"{'method':<34}{'write GB/s':>12}{'read GB/s':>12}")
    for name, r in rows.items():
        if isinstance(r, tuple):
            print(f"{name:<34}{r[0]:>12.2f}{r[1]:>12.2f}")
        else:
            print(f"{name:<34}{r:>24}")
    fio = rows.get("fio libaio O_DIRECT (raw disk)")
    zk = rows["zerokit aio (aligned buffer)"]
    if isinstance(fio, tuple):
        print(f"zerokit / fio: write {100 * zk[0] / fio[0]:.0f}%, read {100 * zk[1] / fio[1]:.0f}%")
    print(f"compute loop (1 thread): alone {slow['alone_s']:.2f} s, while streaming "
          f"{slow['io_GBps_during']:.2f} GB/s {slow['with_io_s']:.2f} s: "
          f"slowdown {slow['slowdown_pct']:+.1f}%")
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_nvme.json"), "w") as f:
        json.dump({"bytes": nbytes, "config": vars(args), "cache_dropped": cache_dropped,
                   "rows": {k: (list(v) if isinstance(v, tuple) else v) for k, v in rows.items()},
                   "compute": slow}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
