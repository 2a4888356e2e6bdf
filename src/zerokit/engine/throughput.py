"""Samples per second of the training loop, as DeepSpeed's `engine.tput_timer` reports it.

The engine starts the timer in forward and stops it in step, so the time measured is forward,
backward and step (not data loading). The first `start_step` optimizer steps are warm-up and are
not counted, as in DeepSpeed's ThroughputTimer.
"""
from __future__ import annotations

import time

import torch


class ThroughputTimer:
    def __init__(self, batch_size: int, start_step: int = 2):
        self.batch_size = batch_size  # samples per optimizer step, all ranks (train_batch_size)
        self.start_step = start_step
        self.global_step_count = 0
        self.micro_step_count = 0
        self.total_elapsed_time = 0.0  # seconds, over the counted steps
        self.step_elapsed_time = 0.0  # seconds, since the last optimizer step
        self._started_at: float | None = None

    def start(self) -> None:
        if self._started_at is None:  # several forwards per step (evaluation) keep the first start
            _sync()
            self._started_at = time.perf_counter()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End a micro-step; on an optimizer step (global_step=True) count it. report_speed is
        accepted for DeepSpeed's signature; zerokit reports speed through avg_samples_per_sec."""
        if self._started_at is None:
            return
        _sync()
        elapsed = time.perf_counter() - self._started_at
        self._started_at = None
        self.micro_step_count += 1
        self.step_elapsed_time += elapsed
        if global_step:
            self.global_step_count += 1
            if self.global_step_count > self.start_step:
                self.total_elapsed_time += self.step_elapsed_time
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
