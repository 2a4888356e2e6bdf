"""`engine.timers`: DeepSpeed's SynchronizedWallClockTimer, named timers a script starts and stops.

DeepSpeed's engine always has one (deepspeed/utils/timer.py); scripts time their own regions
with `engine.timers("name").start()` / `.stop()` and read `.elapsed()` (milliseconds) or log a
group with `engine.timers.log([...])`. zerokit's engine times its own forward / backward / step
separately (the wall_clock_breakdown line), so these timers hold only what the script starts.
Host clock after a device synchronize, as DeepSpeed's CPU accelerator (host timers).
"""
from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("zerokit")


def _now() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # kernels are asynchronous: time what ran, not what was launched
    return time.time()


class WallClockTimer:
    """One named timer: intervals between start() and stop(), summed by elapsed() in ms."""

    def __init__(self, name: str):
        self.name_ = name
        self.started_ = False
        self.start_time = 0.0
        self.end_time = 0.0
        self.event_timers: list[float] = []  # seconds per interval
        self.elapsed_records: list[float] | None = None  # ms per interval, after elapsed()

    def start(self) -> None:
        if self.started_:  # DeepSpeed asserts the same
            raise AssertionError(f"{self.name_} timer has already been started")
        self.start_time = _now()
        self.started_ = True

    def stop(self, reset: bool = False, record: bool = False) -> None:
        """reset and record are DeepSpeed's arguments; it ignores both on host timers too."""
        if not self.started_:
            raise AssertionError("timer is not started")
        self.end_time = _now()
        self.event_timers.append(self.end_time - self.start_time)
        self.started_ = False

    def reset(self) -> None:
        self.started_ = False
        self.elapsed_records = None
        self.event_timers.clear()

    def elapsed(self, reset: bool = True) -> float:
        """Milliseconds over the intervals so far (one in progress is closed and reopened)."""
        running = self.started_
        if running:
            self.stop()
        self.elapsed_records = [t * 1000.0 for t in self.event_timers]
        total = sum(self.elapsed_records)
        if reset:
            self.reset()
        if running:
            self.start()
        return total

    def mean(self) -> float:
        """The 10%-trimmed mean of the intervals in ms (DeepSpeed's trim_mean of its records)."""
        self.elapsed(reset=False)
        return _trim_mean(self.elapsed_records or [], 0.1)


class WallClockTimers:
    """The group: `timers(name)` makes or returns the named timer."""

    Timer = WallClockTimer

    def __init__(self):
        self.timers: dict[str, WallClockTimer] = {}

    def get_timers(self) -> dict[str, WallClockTimer]:
        return self.timers

    def __call__(self, name: str) -> WallClockTimer:
        if name not in self.timers:
            self.timers[name] = WallClockTimer(name)
        return self.timers[name]

    @staticmethod
    def memory_usage() -> str:
        """DeepSpeed's memory line, from the accelerator's figures (the RSS on the CPU)."""
        from zerokit.compat.deepspeed.accelerator import get_accelerator

        acc, gib = get_accelerator(), 1024 ** 3
        return (f" | mem_allocated: {acc.memory_allocated() / gib:.4f} GB | max_mem_allocated: "
                f"{acc.max_memory_allocated() / gib:.4f} GB | cache_allocated: {acc.memory_reserved() / gib:.4f} "
                f"GB | max_cache_allocated: {acc.max_memory_reserved() / gib:.4f} GB")

    def log(self, names, normalizer: float = 1.0, reset: bool = True, memory_breakdown: bool = False,
            ranks=None) -> None:
        """Log 'time (ms) | name: ms | ...' for the named timers that exist, on `ranks` (rank 0)."""
        if normalizer <= 0.0:
            raise ValueError(f"timers.log: normalizer must be > 0 (got {normalizer})")
        text = "time (ms)" + "".join(f" | {n}: {self.timers[n].elapsed(reset=reset) / normalizer:.2f}"
                                     for n in names if n in self.timers)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank in (ranks or [0]):
            print(f"[Rank {rank}] {text}", flush=True)  # DeepSpeed prints it (print_dist)

    def get_mean(self, names, normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        if normalizer <= 0.0:
            raise ValueError(f"timers.get_mean: normalizer must be > 0 (got {normalizer})")
        return {n: self.timers[n].mean() * 1000.0 / normalizer for n in names if n in self.timers}


def _trim_mean(data: list[float], trim_percent: float) -> float:
    """DeepSpeed's trim_mean: the mean without the trim_percent smallest and largest values."""
    n = len(data)
    if n == 0:
        return 0
    data = sorted(data)
    k = int(round(n * trim_percent))
    return sum(data[k:n - k]) / max(n - 2 * k, 1)
