"""DeepSpeed's accelerator object, for the two devices zerokit runs on: CUDA, else the CPU.

On the CPU the memory figures are the process's resident set size (as DeepSpeed's CPU
accelerator reports them); the peaks are the largest value seen by a call since the last
reset_peak_memory_stats().
"""
from __future__ import annotations

import os

import torch


def _rss_bytes() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:  # Linux without psutil
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Accelerator:
    def __init__(self, name: str):
        if name not in ("cuda", "cpu"):
            raise ValueError(f"accelerator {name!r}: zerokit supports 'cuda' and 'cpu'")
        self._name = name
        self._cpu_peak = 0

    @property
    def _cuda(self) -> bool:
        return self._name == "cuda"

    # ---- devices --------------------------------------------------------------------------------
    def device_name(self, device_index: int | str | None = None) -> str:
        if device_index is None or not self._cuda:
            return self._name
        return f"{self._name}:{int(device_index)}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(int(device_index))

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    # ---- random numbers -------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state(device_index or "cuda") if self._cuda else torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, device_index or "cuda")
        else:
            torch.set_rng_state(new_state)

    # ---- memory ---------------------------------------------------------------------------------
    def _cpu_now(self) -> int:
        now = _rss_bytes()
        self._cpu_peak = max(self._cpu_peak, now)
        return now

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else self._cpu_now()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        self._cpu_now()
        return self._cpu_peak

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else self._cpu_now()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else \
            self.max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._cpu_peak = _rss_bytes()

    reset_max_memory_allocated = reset_peak_memory_stats

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """CUDA where torch sees a GPU, else the CPU (DS_ACCELERATOR=cpu|cuda overrides, as in DeepSpeed)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        name = os.environ.get("DS_ACCELERATOR") or ("cuda" if torch.cuda.is_available() else "cpu")
        _ACCELERATOR = Accelerator(name)
    return _ACCELERATOR
