"""The rates the placement planner divides bytes and elements by: measured once per machine and
path with a small probe, cached in a JSON file with the time they were measured.

[Note: measured bandwidths]
- host_copy: bytes/s of one host buffer copied into another (torch `copy_` of PROBE_BYTES, best
  of three): what a gather of a host shard, a gradient to the host and the new weights back cost;
- disk_write / disk_read: bytes/s of a sequential write (then fsync) and read-back of
  PROBE_BYTES in 4 MiB requests in the NVMe path, with O_DIRECT where the filesystem takes it
  (else the written pages are dropped from the page cache before the read); None without a path;
- host_adam / device_adam: Adam updates per second of the native host kernel and of torch's
  AdamW on the compute device (engine/auto_ratio.py `measure_rates`).
Cached in `$ZEROKIT_CACHE_DIR/bandwidths.json` (default `~/.cache/zerokit`) under the key
"<host name>|<device type>|<real path or ->", with the UTC time measured: a later initialize on
the same machine and path reads them instead of probing again (delete the file to re-measure).
`PROBE` is the function `rates()` calls to measure: tests replace it with fixed numbers.
Only rank 0 measures; initialize broadcasts its figures so that every rank plans alike.
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
_CHUNK = 4 << 20


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

    def __post_init__(self):
        for name in ("host_copy", "host_adam", "device_adam", "disk_read", "disk_write"):
            value = getattr(self, name)
            if value is None and name.startswith("disk"):
                continue
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"bandwidth {name} must be a positive number (got {value!r})")

    def describe(self) -> str:
        disk = (f"disk read {self.disk_read / 1e9:.2f} GB/s, write {self.disk_write / 1e9:.2f} GB/s"
                if self.disk_read and self.disk_write else "no NVMe path")
        return (f"host copy {self.host_copy / 1e9:.2f} GB/s, {disk}, host Adam "
                f"{self.host_adam / 1e6:.0f} M elements/s, device Adam {self.device_adam / 1e6:.0f} "
                f"M elements/s ({self.source}{', ' + self.measured_at if self.measured_at else ''})")

    def as_list(self) -> list[float]:
        """Five numbers for a broadcast (0 where there is no disk)."""
        return [self.host_copy, self.disk_read or 0.0, self.disk_write or 0.0, self.host_adam,
                self.device_adam]

    @classmethod
    def from_list(cls, values: list[float], measured_at: str, source: str) -> "Bandwidths":
        h, r, w, ha, da = (float(v) for v in values)
        return cls(h, r or None, w or None, ha, da, measured_at, source)


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


def disk_rates(path: str, nbytes: int = PROBE_BYTES) -> tuple[float, float]:
    """(read, write) bytes/s of a sequential file of `nbytes` in `path`, removed after."""
    buf = mmap.mmap(-1, _CHUNK)  # page-aligned, as O_DIRECT needs
    buf.write(b"\x5a" * _CHUNK)
    name = os.path.join(path, f".zerokit-bandwidth-probe-{os.getpid()}")
    direct = getattr(os, "O_DIRECT", 0)
    try:
        try:
            fd = os.open(name, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | direct, 0o600)
        except OSError:  # tmpfs and some filesystems refuse O_DIRECT
            direct = 0
            fd = os.open(name, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        t0 = time.perf_counter()
        try:
            for _ in range(nbytes // _CHUNK):
                os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        write = nbytes / (time.perf_counter() - t0)
        fd = os.open(name, os.O_RDONLY | direct)
        try:
            if not direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            while os.readv(fd, [buf]) == _CHUNK:
                pass
            read = nbytes / (time.perf_counter() - t0)
        finally:
            os.close(fd)
    finally:
        buf.close()
        try:
            os.unlink(name)
        except OSError:
            pass
    return read, write


def measure(nvme_path: str | None, device: torch.device) -> Bandwidths:
    """The probe: a few hundred milliseconds of copies, one 64 MiB file, two Adam timings."""
    from zerokit.engine.auto_ratio import measure_rates

    host_adam, device_adam = measure_rates(device, 1 << 18)
    read, write = disk_rates(nvme_path) if nvme_path else (None, None)
    return Bandwidths(host_copy_rate(), read, write, host_adam, device_adam,
                      time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "measured")


PROBE: Callable[[str | None, torch.device], Bandwidths] = measure


def cache_file() -> str:
    root = os.environ.get("ZEROKIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                "zerokit")
    return os.path.join(root, "bandwidths.json")


def _key(nvme_path: str | None, device: torch.device) -> str:
    return f"{socket.gethostname()}|{device.type}|{os.path.realpath(nvme_path) if nvme_path else '-'}"


def rates(nvme_path: str | None, device: torch.device) -> Bandwidths:
    """This machine's rates for `nvme_path` on `device`: from the cache, else measured by
    `PROBE` and cached (a cache that cannot be read or written is measured past, not fatal)."""
    path, key = cache_file(), _key(nvme_path, device)
    try:
        with open(path) as f:
            cached = json.load(f)
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key) if isinstance(cached, dict) else None
    if isinstance(entry, dict):
        try:
            fields = {f.name: entry[f.name] for f in dataclasses.fields(Bandwidths) if f.name != "source"}
            return Bandwidths(**fields, source=f"cached in {path}")
        except (KeyError, TypeError, ValueError):
            pass  # an old or damaged entry: measure again
    found = PROBE(nvme_path, device)
    entry = {k: v for k, v in dataclasses.asdict(found).items() if k != "source"}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        cached = cached if isinstance(cached, dict) else {}
        cached[key] = entry
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(cached, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass
    return found
