"""The rates the placement planner divides bytes and elements by: measured once per machine and
path with a small probe, cached in a JSON file with the time they were measured.

[Note: measured bandwidths]
- host_copy: bytes/s of one host buffer copied into another (torch `copy_` of PROBE_BYTES, best
  of three): what a gather of a host shard, a gradient to the host and the new weights back cost;
- disk_write / disk_read: bytes/s of a sequential write (then fsync) and read-back of
  PROBE_BYTES in 4 MiB requests in the NVMe path, with O_DIRECT where the filesystem takes it
  (else the written pages are dropped from the page cache before the read); None without a path;
- disk_mixed: bytes/s read and written together, that file read back while a second one is
  written, through the I/O engine (io/aio.py: blocks in flight, as the optimizer's stream and
  backward's gradient files move them, reads of sub-group i + 1 beside writes of i - 1). A
  queue keeps a disk busier than one request at a time: here 2.2-2.5 GB/s together against
  1.25 read and 1.33 write alone, and bench_infinity's 3B stream moved 2.3-2.7 GB/s; a weight
  shard is read on its own before its gather (the read rate). None without a path or in a
  cache from before it;
- host_adam / device_adam: Adam updates per second of the native host kernel and of torch's
  AdamW on the compute device (engine/auto_ratio.py `measure_rates`).
Cached in `$ZEROKIT_CACHE_DIR/bandwidths.json` (default `~/.cache/zerokit`) under the key
"<host name>|<device type>|<real path or ->", with the UTC time measured: a later initialize on
the same machine and path reads them instead of probing again (delete the file to re-measure).
`PROBE` is the function `rates()` calls to measure: tests replace it with fixed numbers.
Only rank 0 measures; initialize broadcasts its figures so that every rank plans alike.

[Note: the all-gather probe]
With more than one rank, `all_gather_rate` times the process group's own all-gather (the
engine's Comm, so gloo's direct exchange or NCCL's collective, as the units use them) at
GATHER_PROBE_BYTES per rank (one size where the latency dominates, one where the bandwidth
does; the gathered buffer at most GATHER_PROBE_MOST, a transient on the device), best of three after a warm-up, each trial started behind a barrier; the time of a size is
the slowest rank's best (a max all-reduce), so every rank fits the same figures:
t = alpha + bytes / beta, with bytes the gathered buffer's (every rank's piece), alpha >= 0.
A reduce-scatter moves the same bytes, so the gradient buckets are sized from it too
(engine/size_plan.py). Cached in the same file under "<host>|<device type>|all-gather|world
<n>|<backend>" (rank 0's host and cache decide, and broadcast whether to probe, so all ranks
take the same branch); `ALL_GATHER_PROBE` is the function it calls to measure (tests inject
fixed numbers; it must give every rank the same figures). World 1: no probe, None.
"""
from __future__ import annotations

import dataclasses
import json
import mmap
import os
import socket
import time
from dataclasses import dataclass
from typing import Callable

import torch

PROBE_BYTES = 64 << 20
DISK_REQUEST_BYTES = 4 << 20  # the disk probe's request size: the rates hold for requests this large
GATHER_PROBE_BYTES = (256 << 10, 16 << 20)  # per rank: latency-bound, then bandwidth-bound
GATHER_PROBE_MOST = 256 << 20  # the gathered buffer at most (many ranks: smaller pieces each)
BROADCAST_NUMBERS = 6  # Bandwidths.as_list()


@dataclass(frozen=True)
class Bandwidths:
    """Measured rates: bytes/s for copies and disk, elements/s for the Adam updates."""

    host_copy: float
    disk_read: float | None
    disk_write: float | None
    host_adam: float
    device_adam: float
    measured_at: str = ""  # UTC, ISO 8601
    source: str = "measured"  # "measured", "cached in <file>", or what a test injected
    disk_mixed: float | None = None  # reads + writes at once, bytes/s (None: not measured)

    def __post_init__(self):
        for name in ("host_copy", "host_adam", "device_adam", "disk_read", "disk_write", "disk_mixed"):
            value = getattr(self, name)
            if value is None and name.startswith("disk"):
                continue
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"bandwidth {name} must be a positive number (got {value!r})")

    def describe(self) -> str:
        disk = (f"disk read {self.disk_read / 1e9:.2f} GB/s, write {self.disk_write / 1e9:.2f} GB/s"
                if self.disk_read and self.disk_write else "no NVMe path")
        if self.disk_mixed:
            disk += f", both at once {self.disk_mixed / 1e9:.2f} GB/s"
        return (f"host copy {self.host_copy / 1e9:.2f} GB/s, {disk}, host Adam "
                f"{self.host_adam / 1e6:.0f} M elements/s, device Adam {self.device_adam / 1e6:.0f} "
                f"M elements/s ({self.source}{', ' + self.measured_at if self.measured_at else ''})")

    def as_list(self) -> list[float]:
        """BROADCAST_NUMBERS numbers for a broadcast (0 where there is no disk)."""
        return [self.host_copy, self.disk_read or 0.0, self.disk_write or 0.0, self.host_adam,
                self.device_adam, self.disk_mixed or 0.0]

    @classmethod
    def from_list(cls, values: list[float], measured_at: str, source: str) -> "Bandwidths":
        h, r, w, ha, da, m = (float(v) for v in values)
        return cls(h, r or None, w or None, ha, da, measured_at, source, m or None)

    def disk_seconds(self, read: float, written: float) -> float:
        """Seconds to read `read` and write `written` bytes at once through the I/O engine (the
        stream, the gradient files): both at the mixed rate; without one, one after the other
        at the rates of one request at a time."""
        if not self.disk_mixed:
            return read / self.disk_read + written / self.disk_write
        return (read + written) / self.disk_mixed


@dataclass(frozen=True)
class AllGatherRate:
    """One all-gather of `nbytes` (the gathered buffer) takes alpha + nbytes / beta seconds."""

    alpha: float  # s
    beta: float   # bytes/s
    measured_at: str = ""
    source: str = "measured"

    def __post_init__(self):
        if not (isinstance(self.alpha, (int, float)) and self.alpha >= 0):
            raise ValueError(f"all-gather alpha must be a number >= 0 s (got {self.alpha!r})")
        if not (isinstance(self.beta, (int, float)) and self.beta > 0):
            raise ValueError(f"all-gather beta must be a positive number (got {self.beta!r})")

    def describe(self) -> str:
        return (f"all-gather alpha {self.alpha * 1e6:.0f} us, beta {self.beta / 1e9:.2f} GB/s "
                f"({self.source}{', ' + self.measured_at if self.measured_at else ''})")


def fit_latency_bandwidth(nbytes: tuple[int, int], seconds: tuple[float, float]) -> tuple[float, float]:
    """(alpha, beta) of the line through two timings; a larger size timed no slower (noise)
    is read as all bandwidth, a negative intercept as no latency."""
    (b1, b2), (t1, t2) = nbytes, seconds
    if t2 <= t1:
        return 0.0, b2 / t2
    beta = (b2 - b1) / (t2 - t1)
    return max(0.0, t1 - b1 / beta), beta


def _best(fn: Callable[[], None], times: int = 3) -> float:
    best = float("inf")
    for _ in range(times):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def host_copy_rate(nbytes: int = PROBE_BYTES) -> float:
    a = torch.ones(nbytes // 4)
    b = torch.empty_like(a)
    b.copy_(a)  # first touch
    return nbytes / _best(lambda: b.copy_(a))


def disk_rates(path: str, nbytes: int = PROBE_BYTES) -> tuple[float, float, float]:
    """(read, write, mixed) bytes/s in `path`: a sequential file of `nbytes` written then read
    back one request at a time, then (mixed) read again through the I/O engine while it writes
    a second one, both files' bytes over the time both took. The files are removed after."""
    buf = mmap.mmap(-1, DISK_REQUEST_BYTES)  # page-aligned, as O_DIRECT needs
    buf.write(b"\x5a" * DISK_REQUEST_BYTES)
    names = [os.path.join(path, f".zerokit-bandwidth-probe-{os.getpid()}-{i}") for i in range(2)]
    direct = getattr(os, "O_DIRECT", 0)
    try:
        try:
            fd = os.open(names[0], os.O_CREAT | os.O_WRONLY | os.O_TRUNC | direct, 0o600)
        except OSError:  # tmpfs and some filesystems refuse O_DIRECT
            direct = 0
            fd = os.open(names[0], os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        t0 = time.perf_counter()
        try:
            for _ in range(nbytes // DISK_REQUEST_BYTES):
                os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        write = nbytes / (time.perf_counter() - t0)
        fd = os.open(names[0], os.O_RDONLY | direct)
        try:
            if not direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            while os.readv(fd, [buf]) == DISK_REQUEST_BYTES:
                pass
            read = nbytes / (time.perf_counter() - t0)
        finally:
            os.close(fd)
        mixed = engine_mixed_rate(names[0], names[1], nbytes)
    finally:
        buf.close()
        for name in names:
            try:
                os.unlink(name)
            except OSError:
                pass
    return read, write, mixed


def engine_mixed_rate(existing: str, new: str, nbytes: int) -> float:
    """Bytes/s of `existing` (nbytes) read while `new` is written, both through the I/O engine
    (io/aio.py, DeepSpeed's aio defaults: 1 MiB blocks, 8 in flight), as the stream moves them."""
    from zerokit.io.aio import AioConfig, AsyncIO, wait_all
    from zerokit.io.buffers import aligned_empty

    out, into = aligned_empty(nbytes), aligned_empty(nbytes)
    out.fill_(0x5A)
    with AsyncIO(AioConfig()) as aio:
        t0 = time.perf_counter()
        wait_all([aio.write(new, out, fsync=True), aio.read(existing, into)])
        return 2 * nbytes / (time.perf_counter() - t0)


def measure(nvme_path: str | None, device: torch.device) -> Bandwidths:
    """The probe: a few hundred milliseconds of copies, one 64 MiB file, two Adam timings."""
    from zerokit.engine.auto_ratio import measure_rates

    host_adam, device_adam = measure_rates(device, 1 << 18)
    read, write, mixed = disk_rates(nvme_path) if nvme_path else (None, None, None)
    return Bandwidths(host_copy_rate(), read, write, host_adam, device_adam,
                      time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "measured", mixed)


PROBE: Callable[[str | None, torch.device], Bandwidths] = measure


def cache_file() -> str:
    root = os.environ.get("ZEROKIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                "zerokit")
    return os.path.join(root, "bandwidths.json")


def _key(nvme_path: str | None, device: torch.device) -> str:
    return f"{socket.gethostname()}|{device.type}|{os.path.realpath(nvme_path) if nvme_path else '-'}"


def _cached(kind: type, key: str):
    """The cache's `kind` entry under `key`, or None (missing, old or damaged: measure again)."""
    path = cache_file()
    try:
        with open(path) as f:
            entry = json.load(f).get(key)
        fields = {f.name: entry[f.name] for f in dataclasses.fields(kind) if f.name != "source"}
        return kind(**fields, source=f"cached in {path}")
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None


def _store(key: str, found) -> None:
    """Adds `found` under `key` (a cache that cannot be read or written is measured past)."""
    path = cache_file()
    try:
        with open(path) as f:
            cached = json.load(f)
    except (OSError, ValueError):
        cached = {}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        cached = cached if isinstance(cached, dict) else {}
        cached[key] = {k: v for k, v in dataclasses.asdict(found).items() if k != "source"}
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(cached, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass


def rates(nvme_path: str | None, device: torch.device) -> Bandwidths:
    """This machine's rates for `nvme_path` on `device`: from the cache, else measured by
    `PROBE` and cached (a cache that cannot be read or written is measured past, not fatal)."""
    key = _key(nvme_path, device)
    found = _cached(Bandwidths, key)
    if found is None:
        found = PROBE(nvme_path, device)
        _store(key, found)
    return found


def measure_all_gather(comm, per_rank: tuple[int, int] = GATHER_PROBE_BYTES,
                       repeats: int = 3) -> AllGatherRate:
    """The probe of [Note: the all-gather probe]: a collective, every rank calls it."""
    times = []
    per_rank = tuple(min(b, GATHER_PROBE_MOST // comm.world_size) for b in per_rank)
    for nbytes in per_rank:
        n = nbytes // 4
        full = torch.zeros(comm.world_size * n, dtype=torch.float32, device=comm.device)
        full.view(comm.world_size, n)[comm.rank].fill_(comm.rank + 1)

        def gather() -> None:
            comm.all_gather(full, "bandwidth probe: all-gather")
            if full.is_cuda:  # NCCL's wait orders the stream, not the host
                torch.cuda.synchronize(full.device)

        gather()  # warm-up: connections and buffers
        best = float("inf")
        for _ in range(repeats):
            comm.barrier("bandwidth probe: start together")
            t0 = time.perf_counter()
            gather()
            best = min(best, time.perf_counter() - t0)
        times.append(comm.max_flag(best, "bandwidth probe: the slowest rank's time"))
        del full
    alpha, beta = fit_latency_bandwidth(tuple(comm.world_size * b for b in per_rank), tuple(times))
    return AllGatherRate(alpha, beta, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "measured")


ALL_GATHER_PROBE: Callable[..., AllGatherRate] = measure_all_gather


def all_gather_rate(comm) -> AllGatherRate | None:
    """This process group's all-gather (alpha, beta), the same on every rank: rank 0's cached
    figures, else `ALL_GATHER_PROBE` run by every rank and cached by rank 0; None at world 1."""
    if comm.world_size == 1:
        return None
    key = f"{socket.gethostname()}|{comm.device.type}|all-gather|world {comm.world_size}|{comm.backend}"
    cached = _cached(AllGatherRate, key) if comm.rank == 0 else None
    t = torch.tensor([cached.alpha, cached.beta] if cached else [0.0, 0.0], dtype=torch.float64,
                     device=comm.device)
    comm.broadcast_(t, 0, "bandwidths: rank 0's cached all-gather rate")
    if t[1] > 0:
        return cached or AllGatherRate(float(t[0]), float(t[1]), "", "rank 0's cache")
    found = ALL_GATHER_PROBE(comm)
    if comm.rank == 0:
        _store(key, found)
    return found
