"""The rates the placement planner divides bytes and elements by: measured once per machine and
path with a small probe, cached in a JSON file with the time they were measured.

[Note: measured bandwidths]
- host_copy: bytes/s of one host buffer copied into another (torch `copy_` of PROBE_BYTES, best
  of three): what a gather of a host shard, a gradient to the host and the new weights back cost;
- disk_read / disk_write / disk_mixed: bytes/s of one file of PROBE_BYTES read, another
  rewritten, and both at once, through the I/O engine (io/aio.py, DeepSpeed's aio defaults: 1 MiB
  blocks, 8 in flight) in DISK_REQUEST_BYTES requests all submitted together, as the engine moves
  every file it has (weight shards before their gather, backward's gradient files, the step's
  stream); the write made durable (fsync) before its time is taken; each the best of DISK_TRIALS.
  Both files are laid down first, untimed: the engine rewrites its files in place every step, and
  a file's first write, which allocates it, runs several times slower here (0.6-0.9 GB/s against
  2.9-3.3 for the same bytes rewritten; one request at a time 1.1 read, 1.6 write). Until stop 46
  the probe timed a first write and reads one request at a time: 0.69 GB/s both at once while
  bench_infinity's 3B stream moved 2.3-2.7, and the planner, reading the weights as dear as the
  stream, put 3B's weights on NVMe at 67 s a step; with this probe it holds them in RAM: 55.83 s
  (docs/nvme.md, 3B accumulation 4).
  None without a path;
- host_adam / device_adam: Adam updates per second of the native host kernel and of torch's
  AdamW on the compute device (engine/auto_ratio.py `measure_rates`).
Cached in `$ZEROKIT_CACHE_DIR/bandwidths.json` (default `~/.cache/zerokit`) under the key
"<host name>|<device type>|<real path or ->|probe <PROBE_VERSION>", with the UTC time measured
(a new probe's version leaves the old figures unread): a later initialize on
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
import os
import socket
import time
from dataclasses import dataclass
from typing import Callable

import torch

PROBE_BYTES = 64 << 20
DISK_REQUEST_BYTES = 4 << 20  # the disk probe's request size: the rates hold for requests this large
PROBE_VERSION = 2  # in the cache's key: figures of an older probe are measured again
DISK_TRIALS = 3  # the disk probe's rates are the best of this many (a busy disk reads slow once)
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
        stream, the gradient files): both at the mixed rate; without one (rates a caller
        injected), one after the other at the read and write rates."""
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


def disk_rates(path: str, nbytes: int = PROBE_BYTES, trials: int = DISK_TRIALS) -> tuple[float, float, float]:
    """(read, write, mixed) bytes/s in `path`, through the I/O engine as the engine moves its
    files (see [Note: measured bandwidths]): two files of `nbytes` laid down first (untimed), then
    the best of `trials` of: one read back, the other rewritten, and both at once. The files are
    removed after."""
    from zerokit.io.aio import AioConfig, AsyncIO, wait_all
    from zerokit.io.buffers import aligned_empty

    names = [os.path.join(path, f".zerokit-bandwidth-probe-{os.getpid()}-{i}") for i in range(2)]
    out, into = aligned_empty(nbytes), aligned_empty(nbytes)
    out.fill_(0x5A)
    try:
        with AsyncIO(AioConfig()) as aio:
            def move(read: bool, write: bool) -> float:
                if read:  # where the filesystem refused O_DIRECT, read the disk, not the cache
                    _drop_cached_pages(names[0])
                t0 = time.perf_counter()
                handles = []
                for lo in range(0, nbytes, DISK_REQUEST_BYTES):  # every request in flight at once
                    hi = min(nbytes, lo + DISK_REQUEST_BYTES)
                    if write:
                        handles.append(aio.write(names[1], out[lo:hi], lo))
                    if read:
                        handles.append(aio.read(names[0], into[lo:hi], lo))
                wait_all(handles)
                if write:  # durable: a rate that stopped at the page cache would not hold
                    fd = os.open(names[1], os.O_WRONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                return time.perf_counter() - t0

            for name in names:  # laid down once: the engine rewrites its files in place
                aio.write(name, out, fsync=True).wait()
            read = nbytes / min(move(True, False) for _ in range(trials))
            write = nbytes / min(move(False, True) for _ in range(trials))
            mixed = 2 * nbytes / min(move(True, True) for _ in range(trials))
    finally:
        for name in names:
            try:
                os.unlink(name)
            except OSError:
                pass
    return read, write, mixed


def _drop_cached_pages(name: str) -> None:
    """Hand the file's pages in the page cache back (nothing to do for O_DIRECT's files)."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(nvme_path: str | None, device: torch.device) -> Bandwidths:
    """The probe: a few hundred milliseconds of copies, two 64 MiB files, two Adam timings."""
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
    path = os.path.realpath(nvme_path) if nvme_path else "-"
    return f"{socket.gethostname()}|{device.type}|{path}|probe {PROBE_VERSION}"


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
