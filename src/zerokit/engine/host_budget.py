"""Refusing an offload plan the host cannot hold, at start-up, with the numbers.

Offloading moves the fp32 master, the optimizer state and the gradients of each rank's shard
(and with offload_param its weight shard) into host memory, which every rank on a machine
shares. A plan that does not fit used to fail late: the kernel's OOM killer mid-allocation, or a
machine swapping for hours. Before anything is allocated, `check_host_memory` adds up what the
placement will allocate on this rank, multiplies by the ranks on this machine, and compares it
with the memory available (the smaller of the system's and the cgroup's).
"""
from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass

import psutil
import torch

from zerokit.config.plan import STATE_BYTES_PER_ELEMENT
from zerokit.policy import PlacementPolicy
from zerokit.tier_names import TierName

GiB = 1 << 30
_CGROUP = "/sys/fs/cgroup"


class HostMemoryError(MemoryError):
    """The offload plan needs more host memory than this machine has available."""


@dataclass
class HostNeed:
    """Host bytes this rank's offload placement allocates, by what they hold."""

    weights: int = 0  # offload_param's weight shards
    master: int = 0
    grads: int = 0
    state: int = 0
    buffers: int = 0  # 16-bit outputs and device staging
    restores: int = 0  # step_in_backward: what a rollback restores (parts/speculation.py)

    @property
    def total(self) -> int:
        return self.weights + self.master + self.grads + self.state + self.buffers + self.restores


# Ledger kinds -> HostNeed fields.
_FIELD = {"weights": "weights", "master": "master", "grads": "grads", "buffers": "buffers",
          "optimizer_state": "state", "restores": "restores"}


def host_need(layouts: list, optimizer_kind: str | None,
              state_dtype: torch.dtype = torch.float32) -> HostNeed:
    """The host bytes the units' layouts allocate (policy/layout.py records on the host tier), plus
    the host parts' optimizer state, allocated at bind; an optimizer of unknown kind is counted
    as Adam (8 bytes per element in fp32, 4 in bf16: bf16.bf16_optimizer_states). Transient
    records (a weight shard's NVMe buffer) are not: only the read-ahead's few exist at once
    (engine/byte_plan.py planned_host_need adds them)."""
    need = HostNeed()
    per_element = state_bytes_per_element(optimizer_kind, state_dtype)
    for layout in layouts:
        for kind, nbytes in layout.bytes(TierName.HOST, transient=False).items():
            field = _FIELD[kind]
            setattr(need, field, getattr(need, field) + nbytes)
        need.state += per_element * layout.host_numel
    return need


def speculation_need(layouts: list, optimizer_kind: str | None,
                     master_dtype: torch.dtype = torch.float32,
                     state_dtype: torch.dtype = torch.float32,
                     grad_dtype: torch.dtype | None = None) -> tuple[int, int, int]:
    """step_in_backward's bytes on this rank ([Note: the speculative step] in
    parts/speculation.py): (gradients held in host memory until the step decides, every
    offloaded element's; the host parts' restores: master, state and 16-bit output; the nvme
    parts' second file slot: master and state). A host part's held gradient and restores are in
    its master's and state's dtypes (bf16.bf16_master_weights_and_grads / bf16_optimizer_states),
    as are an nvme part's second file slot; the held gradients are in grad_dtype (placement.
    gradient_dtype; None: the master's)."""
    master = torch.empty(0, dtype=master_dtype).element_size()
    grad = torch.empty(0, dtype=grad_dtype or master_dtype).element_size()
    state = state_bytes_per_element(optimizer_kind, state_dtype)
    held = sum(grad * (lay.host_numel + lay.nvme_numel) for lay in layouts)
    out16 = sum(lay.record("host_out16").nbytes for lay in layouts if lay.has("host_out16"))
    host = sum((master + state) * lay.host_numel for lay in layouts) + out16
    return held, host, sum((master + state) * lay.nvme_numel for lay in layouts)


def state_bytes_per_element(optimizer_kind: str | None,
                            state_dtype: torch.dtype = torch.float32) -> int:
    """Optimizer state bytes per master element (an optimizer of unknown kind counted as Adam):
    STATE_BYTES_PER_ELEMENT counts fp32 states; bf16.bf16_optimizer_states halves them."""
    per_element = STATE_BYTES_PER_ELEMENT.get(optimizer_kind or "", 8)
    return per_element // 2 if state_dtype == torch.bfloat16 else per_element


def available_host_bytes() -> tuple[int, str]:
    """(bytes available to this process's machine or container, where the figure comes from)."""
    avail, source = psutil.virtual_memory().available, "system"
    try:
        with open(os.path.join(_CGROUP, "memory.max")) as f:
            limit = f.read().strip()
        with open(os.path.join(_CGROUP, "memory.current")) as f:
            used = int(f.read())
        if limit != "max" and int(limit) - used < avail:
            avail, source = max(0, int(limit) - used), "cgroup memory.max"
    except (OSError, ValueError):
        pass
    return avail, source


def local_ranks() -> int:
    """Ranks sharing this machine's memory (torchrun's LOCAL_WORLD_SIZE; 1 when unknown)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def check_host_memory(need: HostNeed, placement: PlacementPolicy, ranks: int | None = None,
                      available: tuple[int, str] | None = None) -> None:
    """Raises HostMemoryError when `ranks` ranks each allocating `need` cannot fit."""
    if need.total == 0:
        return
    ranks = local_ranks() if ranks is None else ranks
    avail, source = available or available_host_bytes()
    if need.total * ranks <= avail:
        return
    parts = ", ".join(f"{name} {size(getattr(need, name))}"
                      for name in ("weights", "master", "grads", "state", "buffers", "restores")
                      if getattr(need, name))
    hints = []
    if placement.nvme:
        hints.append(f"lower zero_optimization.offload_optimizer.max_in_cpu (now "
                     f"{placement.ram_numel} elements kept in host memory; the rest is on NVMe) "
                     f"or zero_optimization.sub_group_size / offload_optimizer.buffer_count (the "
                     f"stream's buffers)")
    elif placement.offloads:
        hints.append(f"lower zero_optimization.offload_optimizer.ratio (now {placement.ratio:g}) "
                     f"to keep part of the optimizer on the device")
    if placement.delayed:
        hints.append("turn off delayed_update (it doubles the host gradient buffer)")
    hints.append("spread the ranks over more machines")
    raise HostMemoryError(
        f"the offload plan needs {size(need.total)} of host memory per rank ({parts}) x "
        f"{ranks} rank(s) on this machine = {size(need.total * ranks)}, but {size(avail)} is "
        f"available ({source}); " + "; or ".join(hints))


def size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


AUTO_MARGIN = 0.10  # memory.host "auto": what is available at initialize, less this share


def budgets(cfg) -> dict[TierName, tuple[int, str]]:
    """The config's memory budgets in bytes per tier, each with where it came from."""
    from zerokit.config.schema import parse_size

    out = {}
    for tier in (TierName.HOST, TierName.DEVICE, TierName.NVME):
        value = getattr(cfg.memory, tier.value)
        if value is None:
            continue
        if value == "auto":
            avail, source = available_host_bytes()
            ranks = local_ranks()
            out[tier] = (int(avail * (1 - AUTO_MARGIN)) // ranks,
                         f"memory.host 'auto': {size(avail)} available ({source}) less "
                         f"{AUTO_MARGIN:.0%}, over {ranks} rank(s)")
        else:
            out[tier] = (parse_size(value, f"memory.{tier.value}"), f"memory.{tier.value}")
    return out


class RssWatch:
    """The process's RSS through each step, against the host budget and the ledger ([Note:
    budgets] in tiers/ledger.py).

    A thread samples RSS every `interval_s` and keeps the step's peak with the phase it was in
    (the ledger's) and what the ledger counted then; the boundary step reads it with one more
    sample (`sample`). Past the budget it raises; above what the ledger counts in host memory (the
    host tier, and the device tier on a CPU-only run) plus the RSS at start-up by more than
    `margin`, it warns once, with the numbers (unaccounted memory is a bug to find). Sampled after
    the step only, a 1B run with accumulation 4 peaked at 6.27 GiB against a 5.69 GiB budget in
    forward and backward and was back at 4.4 GiB when the step returned: nothing was reported.
    A sample is one read of /proc/self/statm (a few microseconds), 20 a second; each is also
    appended to the step's memory timeline ([Note: the memory timeline] in tiers/timeline.py)."""

    INTERVAL_S = 0.05

    def __init__(self, ledger, margin: int, device_is_host: bool, interval_s: float = INTERVAL_S):
        self.ledger, self.margin, self.device_is_host = ledger, margin, device_is_host
        # the ledger's tiers in process memory: compute memory is host memory on a CPU-only run
        self.tiers = (TierName.HOST, TierName.DEVICE) if device_is_host else (TierName.HOST,)
        ledger.timeline.set_rss_tiers(self.tiers)
        self.baseline = self.rss() - self.counted()
        self.reported = False
        self._peak = (0, "", 0)  # (rss, phase, counted) since the last `sample`
        self._stop = threading.Event()
        self._thread = None
        if interval_s:
            # through a weak reference: the thread keeps neither this watch nor its ledger alive
            self._thread = threading.Thread(target=_watch, args=(weakref.ref(self), self._stop, interval_s),
                                            name="zerokit-rss-watch", daemon=True)
            self._thread.start()

    @staticmethod
    def rss() -> int:
        return _resident_bytes()

    def counted(self) -> int:
        """What the ledger holds in host memory: the bytes of every kind and the idle scratch
        buffers kept for the next step (tiers/scratch.py); safe to read from the sampling thread."""
        return sum(self.ledger.held(t) for t in self.tiers)

    def poll(self) -> None:
        """One sample, into the step's timeline; a new peak of the step is kept with its phase
        and the ledger's count."""
        rss = self.rss()
        self.ledger.timeline.note_rss(rss)
        if rss > self._peak[0]:
            self._peak = (rss, self.ledger.phase, self.counted())

    def close(self) -> None:
        """Stop the sampling thread (the engine is released)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def sample(self) -> int:
        """At the end of a step: its peak RSS (the thread's samples, and one now) against the host
        budget, and the drift reported once. Returns the drift at the peak (bytes of RSS the
        ledger does not explain)."""
        import logging

        from zerokit.tiers.ledger import BudgetExceededError

        now = (self.rss(), "the step's end", self.counted())
        peak, self._peak = self._peak, (0, "", 0)
        if now[0] >= peak[0]:
            peak = now
        rss, phase, counted = peak
        budget = self.ledger.budget(TierName.HOST)
        if budget is not None and rss > budget:
            raise BudgetExceededError(
                f"the process's RSS, {size(rss)} at its peak ({phase}), is past the host budget of "
                f"{size(budget)} (memory.host); the ledger counted {size(counted)} in host memory "
                f"then and {size(self.baseline)} was there at initialize (interpreter, libraries, "
                f"the model)")
        drift = rss - counted - self.baseline
        if drift > self.margin and not self.reported:
            self.reported = True
            logging.getLogger("zerokit").warning(
                "unaccounted host memory: RSS %s at its peak (%s) = the ledger's %s + %s at "
                "initialize + %s the ledger does not explain (more than memory.rss_margin, %s); "
                "this is reported once",
                size(rss), phase, size(counted), size(self.baseline), size(drift), size(self.margin))
        return drift


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_statm: tuple[int, int | None] = (-1, None)  # (pid, fd): a forked child opens its own


def _resident_bytes() -> int:
    """This process's RSS: /proc/self/statm's resident pages, the file held open (a sample is one
    pread, ~2 microseconds, against psutil's ~30); psutil where there is no /proc."""
    global _statm
    pid = os.getpid()
    if _statm[0] != pid:
        try:
            _statm = (pid, os.open("/proc/self/statm", os.O_RDONLY))
        except OSError:
            _statm = (pid, None)
    if _statm[1] is not None:
        try:
            return int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            pass
    return psutil.Process().memory_info().rss


def _watch(ref: "weakref.ref[RssWatch]", stop: threading.Event, interval_s: float) -> None:
    while not stop.wait(interval_s):
        watch = ref()
        if watch is None:
            return
        try:
            watch.poll()
        except Exception:  # a sample that failed (the process is exiting): the next one counts
            pass
        del watch
