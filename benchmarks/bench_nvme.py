"""NVMe offload throughput: zerokit's async I/O engine (both native backends) vs fio (the raw
disk), torch.save/load and DeepSpeed's async I/O op, all at the same block size and queue depth;
plus how much a compute loop on the other core slows down while each streams.

    flock /tmp/zk-heavy.lock .venv/bin/python benchmarks/bench_nvme.py [--size-gib 2] [--reps 6]

Fairness: the rows are interleaved (every row writes in turn, then every row reads in turn, and
that `--reps` times, each round starting one row later), so a slow or fast minute of the disk
hits all rows alike; each row reports its best and its median. Every write is durable before its
clock stops (fsync; fio end_fsync=1).
Every read row but torch.load reads one common file written once before the rounds, so that
a file's layout on disk (which depends on how it was written) is the same for every reader.
Reads come from the disk: O_DIRECT bypasses the page cache (zerokit, fio, DeepSpeed), and the
cache is dropped before every read anyway (root) for torch.load; the header says if it was not.
Memory footprint: fio reads into and writes from block_size * iodepth bytes, reused; the ring row
does the same through zerokit's streaming reader, the other engine rows move one buffer of the
whole size (on this VM a read into a fresh 2 GiB runs slower than into a few cached MiB).
The compute rows pair a 1-thread matmul loop alone with the same loop during I/O, interleaved,
and report the median slowdown; fio's rows are the floor the disk itself imposes.
Prints tables and writes benchmarks/results/bench_nvme-<time>.json (and -latest.json).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import warnings

import torch

from _common import format_table, machine_info, summarize, write_json
from zerokit.io import AioConfig, AsyncIO, aligned_empty, huge_pages
from zerokit.io.stream import read_chunks, ring_pool

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


# ------------------------------------------------------------------------------ throughput rows
class ZerokitRow:
    def __init__(self, cfg: AioConfig, path: str, nbytes: int, backend: str, ordinary: bool):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            self.aio = AsyncIO(cfg, backend=backend)
        # An ordinary torch tensor sits at 64 mod 4096; the file offset takes the same residue,
        # as the swapper does, so only the edge sectors are staged.
        self.buf = torch.empty(nbytes, dtype=torch.uint8) if ordinary else aligned_empty(nbytes)
        self.buf.fill_(7)
        self.path, self.off = path, self.buf.data_ptr() % 4096
        self.read_path = path  # throughput() points it at the common file

    def write(self) -> float:
        return timed(lambda: self.aio.write(self.path, self.buf, self.off, fsync=True).wait())

    def read(self) -> float:
        return timed(lambda: self.aio.read(self.read_path, self.buf, self.off).wait())

    def close(self) -> None:
        self.aio.close()


class RingRow:
    """The engine with fio's memory footprint: the file streams through block_size *
    queue_depth * thread_count bytes of buffers (zerokit.io.stream.ring_pool: buffers of two
    blocks), reused, with read_chunks, the swapper's NVMe -> host -> device path. Writes send
    the ring's bytes over and over, as fio does."""

    def __init__(self, cfg: AioConfig, path: str, nbytes: int):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            self.aio = AsyncIO(cfg, backend="linux-aio")
        self.pool = ring_pool(cfg, pin=False)
        self.path, self.nbytes, self.block = path, nbytes, self.pool.buffer_bytes
        self.read_path = path

    def write(self) -> float:
        def write():
            bufs = [self.pool.acquire() for _ in range(self.pool.capacity)]
            in_flight = collections.deque()
            for i, off in enumerate(range(0, self.nbytes, self.block)):
                if len(in_flight) == len(bufs):
                    in_flight.popleft().wait()
                n = min(self.block, self.nbytes - off)
                in_flight.append(self.aio.write(self.path, bufs[i % len(bufs)][:n], off))
            for h in in_flight:
                h.wait()
            fd = os.open(self.path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            for b in bufs:
                self.pool.release(b)
        return timed(write)

    def read(self) -> float:
        def read():
            for _ in read_chunks(self.aio, self.read_path, self.nbytes, self.pool):
                pass
        return timed(read)

    def close(self) -> None:
        self.aio.close()


class FioRow:
    """fio, libaio, O_DIRECT, one job at the engine's total queue depth. Its own bandwidth
    figure (bytes / I/O time, end_fsync included for writes) becomes a time for the table."""

    def __init__(self, cfg: AioConfig, path: str, nbytes: int):
        self.nbytes, self.path, self.read_path = nbytes, path, path
        self.cmd = ["fio", "--output-format=json", "--name=zk", "--direct=1",
                    "--ioengine=libaio", f"--bs={cfg.block_size}",
                    f"--iodepth={cfg.queue_depth * cfg.thread_count}", f"--size={nbytes}",
                    "--numjobs=1"]

    def _run(self, rw: str, path: str, extra: list[str]) -> float:
        p = subprocess.run(self.cmd + [f"--filename={path}", f"--rw={rw}"] + extra,
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"fio failed: {p.stderr}")
        job = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0][rw]
        if job["io_bytes"] != self.nbytes:
            raise RuntimeError(f"fio {rw} moved {job['io_bytes']} bytes of {self.nbytes}")
        return self.nbytes / job["bw_bytes"]

    def write(self) -> float:
        return self._run("write", self.path, ["--end_fsync=1"])

    def read(self) -> float:
        return self._run("read", self.read_path, [])

    def close(self) -> None:
        pass


class TorchSaveRow:
    def __init__(self, path: str, nbytes: int):
        self.t = torch.full((nbytes,), 7, dtype=torch.uint8)
        self.path = self.read_path = path  # torch.load needs torch.save's format: its own file
        self.own_file_reads = True

    def write(self) -> float:
        def save():
            with open(self.path, "wb") as f:
                torch.save(self.t, f)
                f.flush()
                os.fsync(f.fileno())  # as durable as the others
        return timed(save)

    def read(self) -> float:
        return timed(lambda: torch.load(self.path, mmap=False))

    def close(self) -> None:
        pass


class DeepSpeedRow:
    def __init__(self, cfg: AioConfig, path: str, nbytes: int):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from deepspeed.ops.op_builder import AsyncIOBuilder
            ops = AsyncIOBuilder().load(verbose=False)
        self.h = ops.aio_handle(cfg.block_size, cfg.queue_depth, cfg.single_submit,
                                cfg.overlap_events, cfg.thread_count)
        self.buf = self.h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
        self.buf.fill_(7)
        self.path = self.read_path = path

    def write(self) -> float:
        def write():
            self.h.async_pwrite(self.buf, self.path)
            self.h.wait()
            fd = os.open(self.path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        return timed(write)

    def read(self) -> float:
        def read():
            self.h.async_pread(self.buf, self.read_path)
            self.h.wait()
        return timed(read)

    def close(self) -> None:
        self.h.free_cpu_locked_tensor(self.buf)


RING = "zerokit linux-aio (ring, fio's footprint)"
DS_RING = "deepspeed aio (ring, fio's footprint)"


class DeepSpeedRingRow(DeepSpeedRow):
    """DeepSpeed's op with the same footprint as the ring row: one locked buffer of
    block_size * queue_depth * thread_count, filled or drained per call. Its handle's wait()
    waits for everything outstanding, so a call runs its blocks in parallel and then drains."""

    def __init__(self, cfg: AioConfig, path: str, nbytes: int):
        super().__init__(cfg, path, cfg.block_size * cfg.queue_depth * cfg.thread_count)
        self.nbytes = nbytes

    def _each(self, op, path: str) -> None:
        step = self.buf.numel()
        for off in range(0, self.nbytes, step):
            op(self.buf[:min(step, self.nbytes - off)], path, off)
            self.h.wait()

    def write(self) -> float:
        def write():
            self._each(self.h.async_pwrite, self.path)
            fd = os.open(self.path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        return timed(write)

    def read(self) -> float:
        return timed(lambda: self._each(self.h.async_pread, self.read_path))


def make_rows(cfg: AioConfig, d: str, nbytes: int, skip: list[str]) -> dict[str, object]:
    path = lambda name: os.path.join(d, f"{name}.bin")  # noqa: E731 - one file per row
    rows: dict[str, object] = {
        "zerokit linux-aio (aligned buffer)": ZerokitRow(cfg, path("zk_aio"), nbytes,
                                                         "linux-aio", False),
        "zerokit linux-aio (ordinary tensor)": ZerokitRow(cfg, path("zk_aio_t"), nbytes,
                                                          "linux-aio", True),
        "zerokit psync-threads (aligned)": ZerokitRow(cfg, path("zk_thr"), nbytes,
                                                      "psync-threads", False),
        RING: RingRow(cfg, path("zk_ring"), nbytes),
    }
    if "fio" not in skip:
        rows["fio libaio O_DIRECT (raw disk)"] = (FioRow(cfg, path("fio"), nbytes)
                                                  if shutil.which("fio") else "not installed")
    if "torch" not in skip:
        rows["torch.save / torch.load"] = TorchSaveRow(path("torch"), nbytes)
    if "deepspeed" not in skip:
        try:
            rows["deepspeed AsyncIOBuilder aio"] = DeepSpeedRow(cfg, path("ds"), nbytes)
            rows[DS_RING] = DeepSpeedRingRow(cfg, path("ds_ring"), nbytes)
        except Exception as e:  # not installed, or libaio-dev missing for its JIT build
            rows["deepspeed AsyncIOBuilder aio"] = f"not available ({type(e).__name__})"
    return rows


def write_common(path: str, nbytes: int) -> None:
    """A file of nbytes written front to back in 8 MiB pieces, then made durable."""
    piece = os.urandom(8 << 20)
    with open(path, "wb") as f:
        for off in range(0, nbytes, len(piece)):
            f.write(piece[:min(len(piece), nbytes - off)])
        f.flush()
        os.fsync(f.fileno())


def throughput(rows: dict[str, object], nbytes: int, reps: int, common: str) -> dict[str, dict]:
    """Interleaved: all rows write, then all rows read, reps times. Round r starts at row r
    (rotation): the disk under this VM is a host file whose cache favours recently written
    files, so a fixed order would favour fixed rows. Even rounds write into a fresh file, odd
    rounds overwrite: every row gets both.
    Every row but torch.load reads one common file, written once before the rounds in one
    sequential pass: here a file's layout, which depends on how it was written, moved a reader
    by 2x (DeepSpeed's 8 MiB calls: 1.4 GB/s on a file zerokit wrote, 2.5 on its own), and a
    read row should measure the reader. The extra 4096 bytes serve the ordinary tensor's
    offset."""
    write_common(common, nbytes + 4096)
    gbps: dict[str, dict[str, list[float]]] = {n: {"write": [], "read": []} for n in rows}
    names = [n for n, r in rows.items() if not isinstance(r, str)]
    for name in names:
        if not getattr(rows[name], "own_file_reads", False):
            rows[name].read_path = common
    for rep in range(reps):
        k = rep % len(names)
        live = {n: rows[n] for n in names[k:] + names[:k]}
        for name, row in live.items():
            if rep % 2 == 0 and os.path.exists(row.path):
                os.unlink(row.path)
            gbps[name]["write"].append(nbytes / row.write() / 1e9)
        for name, row in live.items():
            drop_caches()
            gbps[name]["read"].append(nbytes / row.read() / 1e9)
    return gbps


# ------------------------------------------------------------------------------- compute rows
def task_cpu_ns() -> dict[str, int]:
    """CPU time of every thread of this process (schedstat: nanoseconds on a CPU)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[0])
        except OSError:
            pass
    return out


class StreamLoad:
    """Streams writes or reads of one file until stopped, started and stopped once per pair;
    reports GB/s and the CPU seconds per GB its threads spent (the compute thread excluded).
    kind: an AsyncIO backend (zerokit's huge-page buffer), "linux-aio ordinary" (an ordinary
    torch tensor on 4 KiB pages), "linux-aio ring" (reads through the ring row's buffers),
    "fio", or "none" (no I/O: the noise of the pairing itself)."""

    def __init__(self, kind: str, direction: str, cfg: AioConfig, d: str, nbytes: int):
        self.kind, self.direction, self.cfg, self.nbytes = kind, direction, cfg, nbytes
        self.path = os.path.join(d, f"load_{kind.replace(' ', '_')}.bin")
        if kind in ("none", "fio"):
            if kind == "fio" and not os.path.exists(self.path):
                with open(self.path, "wb") as f:
                    f.truncate(nbytes)
                subprocess.run(self._fio_cmd("write", time_based=False), check=True,
                               capture_output=True)
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            self.aio = AsyncIO(cfg, backend=kind.split()[0])
        self.buf = (torch.empty(nbytes, dtype=torch.uint8) if kind.endswith("ordinary")
                    else aligned_empty(nbytes)).fill_(3)
        self.off = self.buf.data_ptr() % 4096  # as the swapper places an ordinary tensor
        self.aio.write(self.path, self.buf, self.off).wait()
        if kind.endswith("ring"):
            self.pool = ring_pool(cfg, pin=False)

    def _fio_cmd(self, rw: str, time_based: bool = True) -> list[str]:
        return (["fio", "--output-format=json", "--name=load", f"--filename={self.path}",
                 "--direct=1", "--ioengine=libaio", f"--bs={self.cfg.block_size}",
                 f"--iodepth={self.cfg.queue_depth * self.cfg.thread_count}",
                 f"--size={self.nbytes}", f"--rw={rw}"]
                + (["--time_based", "--runtime=600"] if time_based else []))

    def start(self) -> None:
        self.moved, self.stop_evt = 0, threading.Event()
        if self.kind == "none":
            return
        if self.kind == "fio":
            self.proc = subprocess.Popen(self._fio_cmd(self.direction), stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
            return
        if self.kind.endswith("ring"):
            def op(path, buf, off):  # the whole file through the ring, as RingRow.read
                for _ in read_chunks(self.aio, path, self.nbytes, self.pool, offset=off):
                    pass
        else:
            submit = self.aio.write if self.direction == "write" else self.aio.read

            def op(path, buf, off):
                submit(path, buf, off).wait()

        def run():
            while not self.stop_evt.is_set():
                op(self.path, self.buf, self.off)
                self.moved += self.nbytes

        self.thread = threading.Thread(target=run)
        self.t0, self.cpu0 = time.perf_counter(), task_cpu_ns()
        self.thread.start()

    def stop(self, compute_tid: str) -> tuple[float, float]:
        if self.kind == "none":
            return 0.0, 0.0
        if self.kind == "fio":
            self.proc.terminate()
            out = self.proc.communicate()[0]
            job = json.loads(out[out.index("{"):])["jobs"][0]
            gbps = job[self.direction]["bw_bytes"] / 1e9
            secs = job["job_runtime"] / 1e3
            cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100 * secs
            return gbps, cpu_s / max(gbps * secs, 1e-9)
        cpu1, t1 = task_cpu_ns(), time.perf_counter()
        self.stop_evt.set()
        self.thread.join()
        spent = sum(v - self.cpu0.get(k, 0) for k, v in cpu1.items() if k != compute_tid)
        gb = self.moved / 1e9
        return gb / (t1 - self.t0), spent / 1e9 / max(gb, 1e-9)

    def close(self) -> None:
        if hasattr(self, "aio"):
            self.aio.close()


def directions(kind: str) -> tuple[str, ...]:
    return {"none": ("-",), "linux-aio ring": ("read",)}.get(kind, ("write", "read"))


def compute_slowdown(cfg: AioConfig, d: str, nbytes: int, pairs: int,
                     kinds: list[str]) -> dict[str, dict]:
    """Each pair times the loop alone and with one load streaming (in alternating order); pairs
    are interleaved over the loads so that a noisy minute of the machine spreads over all."""
    torch.set_num_threads(1)
    a = torch.randn(384, 384)

    def loop():
        x = a
        for _ in range(600):
            x = torch.tanh(x @ a)

    loop()
    tid = str(threading.get_native_id())
    loads = {f"{k} {rw}": StreamLoad(k, rw, cfg, d, nbytes)
             for k in kinds for rw in directions(k)}
    res = {name: {"slowdown_pct": [], "GBps": [], "cpu_s_per_GB": []} for name in loads}

    def alone() -> float:
        time.sleep(0.3)  # as idle before the clock as the busy run
        return timed(loop)

    def busy(name: str) -> float:
        loads[name].start()
        time.sleep(0.3)  # the stream at full speed before the clock starts
        t = timed(loop)
        gbps, cpu = loads[name].stop(tid)
        res[name]["GBps"].append(gbps)
        res[name]["cpu_s_per_GB"].append(cpu)
        return t

    try:
        for i in range(pairs):
            for name in loads:
                # Alternate which half of the pair runs first, so drift within a pair cancels.
                if i % 2 == 0:
                    t_alone, t_busy = alone(), busy(name)
                else:
                    t_busy, t_alone = busy(name), alone()
                res[name]["slowdown_pct"].append(100 * (t_busy / t_alone - 1))
    finally:
        for load in loads.values():
            load.close()
    return res


# ------------------------------------------------------------------------------------- report
def pct(stat, ours: list[float], theirs: list[float]) -> str:
    return f"{100 * stat(ours) / stat(theirs):.0f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(__file__), "..", ".bench_nvme"))
    ap.add_argument("--block-size", type=int, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--thread-count", type=int, default=1)
    ap.add_argument("--reps", type=int, default=6,
                    help="interleaved rounds of every row (one per row: each leads once)")
    ap.add_argument("--pairs", type=int, default=9, help="alone/with-I/O pairs per compute row")
    ap.add_argument("--skip", nargs="*", default=[], help="rows to skip: fio torch deepspeed")
    args = ap.parse_args()
    nbytes = int(args.size_gib * GiB)
    cfg = AioConfig(block_size=args.block_size, queue_depth=args.queue_depth,
                    thread_count=args.thread_count)
    d = os.path.abspath(args.dir)
    os.makedirs(d, exist_ok=True)
    cache_dropped = drop_caches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        auto_backend = AsyncIO(cfg).backend
    rows = make_rows(cfg, d, nbytes, args.skip)
    try:
        gbps = throughput(rows, nbytes, args.reps, os.path.join(d, "common.bin"))
        kinds = ["none", "linux-aio", "linux-aio ring", "linux-aio ordinary", "psync-threads"]
        if isinstance(rows.get("fio libaio O_DIRECT (raw disk)"), FioRow):
            kinds.append("fio")
        slow = compute_slowdown(cfg, d, min(nbytes, GiB // 2), args.pairs, kinds)
    finally:
        for r in rows.values():
            if not isinstance(r, str):
                r.close()
        shutil.rmtree(d, ignore_errors=True)

    print(f"\nNVMe I/O, {nbytes / GiB:.2f} GiB, block {cfg.block_size >> 10} KiB, queue depth "
          f"{cfg.queue_depth} x {cfg.thread_count} thread(s) for every row; reads of one common "
          f"file (torch.load: its own); backend 'auto' "
          f"here: {auto_backend}; {args.reps} interleaved rounds; page cache dropped before "
          f"reads: {'yes' if cache_dropped else 'NO (not root): torch.load may hit the cache'}; "
          f"THP {huge_pages.thp_mode()} (zerokit's aligned buffers ask for huge pages, an "
          f"ordinary tensor has 4 KiB pages)")
    table = []
    for name, r in gbps.items():
        if isinstance(rows[name], str):
            table.append([name, rows[name], "", "", ""])
            continue
        w, rd = r["write"], r["read"]
        table.append([name, f"{max(w):.2f}", f"{statistics.median(w):.2f}", f"{max(rd):.2f}",
                      f"{statistics.median(rd):.2f}"])
    print(format_table(["method", "write best", "write median", "read best", "read median"],
                       table))
    fio = gbps.get("fio libaio O_DIRECT (raw disk)")
    ds = gbps.get("deepspeed AsyncIOBuilder aio")
    ds_ring = gbps.get(DS_RING)
    for zk_name, zk, refs in (
            ("one buffer", gbps["zerokit linux-aio (aligned buffer)"],
             (("fio", fio), ("deepspeed one buffer", ds))),
            ("ring", gbps[RING], (("fio", fio), ("deepspeed ring", ds_ring)))):
        for ref_name, ref in refs:
            if ref and ref["write"]:
                print(f"zerokit linux-aio {zk_name} / {ref_name}: "
                      f"write best {pct(max, zk['write'], ref['write'])}"
                      f" median {pct(statistics.median, zk['write'], ref['write'])}"
                      f", read best {pct(max, zk['read'], ref['read'])}"
                      f" median {pct(statistics.median, zk['read'], ref['read'])}")
    print(f"\ncompute loop (1 thread, 384x384 matmul+tanh) while streaming "
          f"{min(nbytes, GiB // 2) / GiB:.2f} GiB repeatedly; {args.pairs} interleaved pairs")
    print(format_table(
        ["I/O load", "slowdown median", "slowdown min..max", "GB/s", "I/O CPU s per GB"],
        [[name, f"{statistics.median(r['slowdown_pct']):+.1f}%",
          f"{min(r['slowdown_pct']):+.1f}..{max(r['slowdown_pct']):+.1f}%",
          f"{statistics.median(r['GBps']):.2f}", f"{statistics.median(r['cpu_s_per_GB']):.3f}"]
         for name, r in slow.items()]))
    path = write_json("bench_nvme", {
        "machine": machine_info(), "bytes": nbytes, "config": vars(args),
        "auto_backend": auto_backend, "cache_dropped": cache_dropped,
        "thp": huge_pages.thp_mode(),
        "throughput_GBps": {k: (rows[k] if isinstance(rows[k], str) else
                                {rw: {"all": v, **summarize(v)} for rw, v in r.items()})
                            for k, r in gbps.items()},
        "compute": {k: {m: {"all": v, **summarize(v)} for m, v in r.items()}
                    for k, r in slow.items()}})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    sys.exit(main())
