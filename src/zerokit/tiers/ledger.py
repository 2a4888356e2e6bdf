"""The byte ledger: bytes per tier and per kind on this rank, counted at every allocation.

The start-up plan, the end-of-run report, the tests and the budgets all read these numbers, so
they cannot disagree. Long-lived buffers are held under a name by the tier that allocates them
(tiers/tier.py) and `release`-d when freed; transient buffers (a gradient bucket in flight) go
through `transient`, which tracks the peak as well.
"""
from __future__ import annotations

# [Note: budgets]
# A tier may have a budget (config "memory": host / device / nvme, set by initialize before the
# units allocate). Every count that grows is checked against it: a Tier checks before it
# allocates (`check_room`), bytes counted after the fact (torch's optimizer state, a gathered
# buffer) when they are counted; crossing it raises BudgetExceededError with the tier's
# breakdown by kind and the allocation that crossed, and the count is left as it was. The
# process's RSS is sampled through each step and its peak checked against the host budget when
# the step ends (engine/host_budget.py RssWatch), which also reports memory the ledger does not
# account for.

from collections import defaultdict
from typing import Callable

import torch

from zerokit.sizes import mib
from zerokit.tier_names import TierName
from zerokit.tiers.scratch import ScratchCache
from zerokit.tiers.timeline import MemoryTimeline, Timeline

TIERS = tuple(TierName)
_TIER_TEXT = tuple(t.value for t in TIERS)  # errors print ('device', 'host', 'nvme')
# restores: what the speculative step's rollback restores from (parts/speculation.py)
KINDS = ("weights", "grads", "master", "optimizer_state", "buffers", "activations", "restores")


class BudgetExceededError(MemoryError):
    """An allocation would take a tier past its budget (config "memory")."""


class Ledger:
    def __init__(self, cpu_is_device: bool = True):
        # On a CPU-only run, compute memory *is* host memory; the ledger still calls it "device"
        # so that a plan reads the same everywhere and host offload stays distinguishable.
        self.cpu_is_device = cpu_is_device
        self._held: dict[str, tuple[str, str, int]] = {}
        self._current: dict[tuple[str, str], int] = defaultdict(int)
        self._peak: dict[tuple[str, str], int] = defaultdict(int)
        self._io: dict[str, dict[str, float]] = {}  # tier -> its last step's I/O report
        self.timeline = Timeline()  # see [Note: the memory timeline] in tiers/timeline.py
        self._budget: dict[str, tuple[int, str]] = {}  # tier -> (bytes, where it came from)
        self._tier_now: dict[str, int] = defaultdict(int)
        self._cached: dict[str, int] = defaultdict(int)  # tier -> idle scratch bytes
        self.scratch = ScratchCache(self)  # a step's transient host buffers, reused (tiers/scratch.py)

    def set_budget(self, tier: str, nbytes: int | None, source: str = "") -> None:
        """Enforce `nbytes` on `tier` from now on (None: no budget); see [Note: budgets]."""
        tier = TierName(tier)
        if nbytes is None:
            self._budget.pop(tier, None)
            return
        if self._tier_now[tier] > nbytes:
            raise BudgetExceededError(self._over(tier, 0, f"the budget set ({source})", nbytes))
        self._budget[tier] = (nbytes, source)

    def budget(self, tier: str) -> int | None:
        found = self._budget.get(TierName(tier))
        return found[0] if found else None

    def check_room(self, tier: str, kind: str, nbytes: int, what: "str | Callable[[], str]") -> None:
        """Raise BudgetExceededError if `nbytes` more of `kind` would cross `tier`'s budget.
        what: the allocation, for the error (a function where naming it costs a format)."""
        found = self._budget.get(tier)
        if found is not None and self._tier_now[tier] + nbytes > found[0]:
            what = what() if callable(what) else what
            raise BudgetExceededError(self._over(TierName(tier), nbytes, f"{what} ({kind})", found[0]))

    def _over(self, tier: TierName, nbytes: int, what: str, limit: int) -> str:
        kinds = ", ".join(f"{k} {mib(v)}" for k in KINDS if (v := self._current.get((tier, k), 0)))
        if self._cached.get(tier):
            kinds += f", idle scratch buffers {mib(self._cached[tier])}"
        source = self._budget.get(tier, (0, ""))[1]
        return (f"the {tier.value} budget of {mib(limit)}{f' ({source})' if source else ''} would be "
                f"crossed: {mib(self._tier_now[tier])} held ({kinds or 'nothing'}) + "
                f"{mib(nbytes)} for {what} = {mib(self._tier_now[tier] + nbytes)}; raise "
                f"memory.{tier.value}, or move state off this tier (offload_optimizer / "
                f"offload_param, a higher stage, more ranks)")

    @property
    def phase(self) -> str:
        return self.timeline.phase

    @phase.setter
    def phase(self, name: str) -> None:
        """What the rank is doing now, recorded with each change in the timeline."""
        self.timeline.set_phase(name)

    def end_step(self) -> None:
        """The step ended: its timeline becomes `last_step_timeline()`; scratch sizes it did not
        use are freed."""
        self.scratch.end_step()
        self.timeline.end_step(self._current)

    def last_step_timeline(self) -> MemoryTimeline:
        """The last complete step's timeline (the current one before any step ended)."""
        return self.timeline.last or self.timeline.current()

    def _tier(self, t: torch.Tensor, tier: str | None) -> str:
        if tier is not None:
            if tier not in TIERS:
                raise ValueError(f"tier {tier!r} is not one of {_TIER_TEXT}")
            return TierName(tier)
        return self.cpu_tier() if t.device.type == "cpu" else TierName.DEVICE

    def cpu_tier(self) -> TierName:
        """Where host memory is counted when no tier is named: 'device' on a CPU-only run."""
        return TierName.DEVICE if self.cpu_is_device else TierName.HOST

    def _add(self, key: tuple[str, str], nbytes: int, what: "str | Callable[[], str]" = "") -> None:
        """Every change of a count comes here (a release adds a negative count)."""
        if nbytes > 0 and key[0] in self._budget:
            self.check_room(key[0], key[1], nbytes, what or "a buffer")
        self._tier_now[key[0]] += nbytes
        now = self._current[key] = self._current[key] + nbytes
        if now > self._peak[key]:
            self._peak[key] = now
        self.timeline.note(key[0], key[1], now)

    def count(self, tier: str, kind: str, nbytes: int, what: "str | Callable[[], str]" = "") -> None:
        """Count `nbytes` (negative: fewer) of `kind` on `tier` that nobody holds by name: the
        scratch cache's buffers in use (tiers/scratch.py). Growth is checked against the budget."""
        self._add((TierName(tier), kind), nbytes, what)

    def count_cached(self, tier: str, nbytes: int) -> None:
        """Idle scratch buffers (negative: fewer): held by the process, so they count against the
        tier's budget, but allocated to no kind (as CUDA's reserved against allocated bytes); the
        per-kind tables and the peaks leave them out."""
        tier = TierName(tier)
        self._tier_now[tier] += nbytes
        self._cached[tier] += nbytes

    def held(self, tier: str) -> int:
        """Everything `tier` holds now: every kind and the idle scratch buffers (one read, safe
        from another thread: the RSS watch's sampler)."""
        return self._tier_now.get(TierName(tier), 0)

    def cached_bytes(self, tier: str | None = None) -> int:
        """Bytes of idle scratch buffers kept for reuse (tiers/scratch.py)."""
        return sum(v for t, v in self._cached.items() if tier is None or t == tier)

    def hold_bytes(self, name: str, kind: str, tier: str, nbytes: int) -> None:
        """Count bytes under a name: a tier's allocation (tiers/tier.py), or bytes another owner
        allocated (torch's optimizer state, created lazily by torch)."""
        if kind not in KINDS or tier not in TIERS:
            raise ValueError(f"ledger entry {name!r}: kind {kind!r} / tier {tier!r} not in {KINDS} / {_TIER_TEXT}")
        tier = TierName(tier)
        if name in self._held:
            self.release(name)
        self._add((tier, kind), nbytes, name)  # first: a budget crossed leaves nothing held
        self._held[name] = (tier, kind, nbytes)

    def release(self, name: str) -> None:
        tier, kind, nbytes = self._held.pop(name)
        self._add((tier, kind), -nbytes)

    def relocate(self, source: str, dest: str) -> Callable[[], None]:
        """Count everything `source` holds on `dest` (engine.offload_states moved those bytes);
        returns the function that counts them back. Transient counts move too: nothing may
        release one in between (the engine refuses to train while its states are offloaded)."""
        moved = {kind: n for (tier, kind), n in self._current.items() if tier == source and n}
        self.check_room(dest, "all kinds", sum(moved.values()), f"the states moved from {source}")
        names = [name for name, (tier, _, _) in self._held.items() if tier == source]

        def shift(a: str, b: str) -> None:
            for kind, n in moved.items():
                self._add((a, kind), -n)
                self._add((b, kind), n)
            for name in names:
                if name in self._held:
                    _, kind, n = self._held[name]
                    self._held[name] = (b, kind, n)
        shift(source, dest)
        return lambda: shift(dest, source)

    def transient(self, kind: str, t: torch.Tensor, tier: str | None = None) -> Callable[[], None]:
        """Count a short-lived buffer (tracked in the peak); call the returned function to free it."""
        key = (self._tier(t, tier), kind)
        nbytes = t.numel() * t.element_size()
        self._add(key, nbytes, lambda: f"a transient {kind} buffer of {t.numel():,} elements")
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                self._add(key, -nbytes)
                released = True
        return release

    def record_io(self, tier: str, report: dict[str, float]) -> None:
        """A step's I/O on `tier` (the nvme executor's: bytes read / written, GB/s, wait)."""
        self._io[tier] = dict(report)

    def io(self, tier: str = TierName.NVME) -> dict[str, float]:
        """The last step's I/O report on `tier`, {} if none ran."""
        return dict(self._io.get(tier, {}))

    def bytes(self, tier: str | None = None, kind: str | None = None, peak: bool = False) -> int:
        table = self._peak if peak else self._current
        total = sum(v for (t, k), v in table.items()
                    if (tier is None or t == tier) and (kind is None or k == kind))
        return total

    def table(self, peak: bool = False) -> dict[str, dict[str, int]]:
        return {tier: {kind: self.bytes(tier, kind, peak) for kind in KINDS} for tier in TIERS}

    def format(self, title: str, peak: bool = False) -> str:
        rows = self.table(peak)
        head = f"{'tier':<8}" + "".join(f"{k:>17}" for k in KINDS) + f"{'total':>12}"
        lines = [title, head]
        for tier, kinds in rows.items():
            if not any(kinds.values()):
                continue
            lines.append(f"{tier:<8}" + "".join(f"{mib(v, grouped=False):>17}" for v in kinds.values())
                         + f"{mib(sum(kinds.values()), grouped=False):>12}")
        return "\n".join(lines)
