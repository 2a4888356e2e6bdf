"""`offload_optimizer.ratio: "auto"`: the Twin-Flow split that makes host and device finish together.

The split is fixed when the state is placed (moving optimizer state between tiers mid-run would
cost more than it saves), so the rates are measured at start-up on scratch buffers shaped like the
real work, rather than in the first training steps: the host kernel (Adam, this process's
threads) and torch's AdamW on the device, each over the same number of elements. With host rate
h and device rate d (elements/s), stepping r of n elements on the host takes r*n/h and the rest
(1-r)*n/d; they are equal at r = h / (h + d). The device must also hold master + state + gradient
of its (1-r) part: r is raised until that fits in half of the device memory free now (the other
half is left for activations and the gathered weights).
"""
from __future__ import annotations

import logging
import time

import torch

from zerokit.optim import host as K
from zerokit.sizes import mib

log = logging.getLogger("zerokit")

SAMPLE = 1 << 20  # elements timed on each side: large enough to stream past the caches


def _time(fn, sync) -> float:
    fn()  # warm-up (allocation, first-touch, kernel selection)
    sync()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_rates(device: torch.device, n: int = SAMPLE) -> tuple[float, float]:
    """(host, device) Adam update rates in elements per second."""
    hm, hg, ha, hb = (torch.zeros(n) for _ in range(4))

    def host_step() -> None:
        K.adam_step(hm, hg, ha, hb, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                    step=1, adamw=True)
    p = torch.zeros(n, device=device, requires_grad=True)
    p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return n / _time(host_step, lambda: None), n / _time(opt.step, sync)


def device_free_bytes(device: torch.device) -> int | None:
    """Device memory free now; None where the "device" is the host (no floor applies)."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def choose_ratio(numel: int, device: torch.device, bytes_per_element: int) -> tuple[float, str]:
    """The ratio for "auto" over `numel` optimizer elements on this rank, and a sentence saying
    why: measure, then decide (`balance`)."""
    host_rate, dev_rate = measure_rates(device)
    return balance(host_rate, dev_rate, numel * bytes_per_element, device_free_bytes(device))


def balance(host_rate: float, device_rate: float, device_need: int, device_free: int | None
            ) -> tuple[float, str]:
    """The decision, from measured facts alone: host and device update rates (elements/s), the
    bytes the whole optimizer range would need on the device (master + state + gradient), and the
    device bytes free (None: no device-memory floor)."""
    if not (host_rate > 0 and device_rate > 0):
        raise ValueError(f"offload_optimizer.ratio auto: measured rates must be positive (host "
                         f"{host_rate!r}, device {device_rate!r} elements/s)")
    ratio = host_rate / (host_rate + device_rate)
    why = (f"host Adam {host_rate / 1e6:.0f} M elements/s, device {device_rate / 1e6:.0f} M elements/s: "
           f"ratio {ratio:.2f} makes both finish together")
    if device_free is not None and device_need:
        floor = max(0.0, 1.0 - 0.5 * device_free / device_need)
        if floor > ratio:
            part = mib((1 - floor) * device_need, decimals=0)
            why += (f"; raised to {floor:.2f} so that the device part ({part}) "
                    f"fits in half of the {mib(device_free, decimals=0)} free")
            ratio = floor
    return min(1.0, ratio), why
