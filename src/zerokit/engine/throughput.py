"""Samples per second of the training loop: DeepSpeed's `engine.tput_timer` (ThroughputTimer).

The engine starts the timer in forward and stops it in step, so the time measured is forward,
backward and step (not data loading). The first `start_step` optimizer steps are warm-up and are
not counted, as in DeepSpeed's ThroughputTimer. Its public attributes and methods are
DeepSpeed's (deepspeed/utils/timer.py), so scripts that read or drive it (DeepSpeed-Chat calls
`update_epoch_count()` once per epoch) see the same counters. One difference: several forwards
before a step (an evaluation pass) keep the first start instead of restarting the clock.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger("zerokit")


@dataclass(frozen=True)
class ThroughputTimerConfig:
    """DeepSpeed's `timers.throughput` settings as the timer reads them. zerokit's timer is
    always on and synchronizes the device before reading the clock (the `timers` key is
    accepted and ignored)."""

    enabled: bool = True
    synchronized: bool = True


class ThroughputTimer:
    def __init__(self, batch_size: int, start_step: int = 2, steps_per_output: int | None = None,
                 monitor_memory: bool = False, logging_fn: Callable[[str], None] | None = None):
        if monitor_memory:
            raise NotImplementedError("ThroughputTimer(monitor_memory=True) (DeepSpeed's psutil "
                                      "memory lines) is not provided by zerokit; engine.memory_report() "
                                      "gives the bytes per tier")
        self.config = ThroughputTimerConfig()
        self.batch_size = 1 if batch_size is None else batch_size  # samples per optimizer step, all ranks
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory
        self.logging = logging_fn or log.info
        self.epoch_count = 0
        self.micro_step_count = 0  # since the last update_epoch_count(), as DeepSpeed
        self.global_step_count = 0
        self.total_elapsed_time = 0.0  # seconds, over the counted steps
        self.step_elapsed_time = 0.0  # seconds, since the last optimizer step
        self.start_time = 0.0
        self.end_time = 0.0
        self.started = False
        self.initialized = False

    def update_epoch_count(self) -> None:
        """A new epoch: count it and restart the micro-step count (DeepSpeed's meaning)."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        self.initialized = True
        if self.started:  # several forwards per step (evaluation) keep the first start
            return
        self.started = True
        _sync()
        self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End a micro-step; on an optimizer step (global_step=True) count it, and every
        steps_per_output steps log DeepSpeed's speed line if report_speed."""
        if not self.started:
            return
        self.started = False
        _sync()
        self.end_time = time.time()
        elapsed = self.end_time - self.start_time
        self.micro_step_count += 1
        self.step_elapsed_time += elapsed
        if not global_step:
            return
        self.global_step_count += 1
        if self.global_step_count > self.start_step:
            self.total_elapsed_time += self.step_elapsed_time
        if report_speed and self.steps_per_output and self.global_step_count % self.steps_per_output == 0:
            self.logging(f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/global_step="
                         f"{self.global_step_count}, RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
                         f"CurrSamplesPerSec={self.batch_size / max(self.step_elapsed_time, 1e-9)}")
        self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        counted = self.global_step_count - self.start_step
        if counted <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")  # DeepSpeed's value before any step is counted
        return self.batch_size / (self.total_elapsed_time / counted)


def _sync() -> None:
    # Kernels are asynchronous: without a sync the timer would measure launch time only.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
