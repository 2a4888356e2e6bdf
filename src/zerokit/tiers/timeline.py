"""The memory timeline: bytes per tier and kind through a step, with the phase they changed in.

[Note: the memory timeline]
The ledger (tiers/ledger.py) calls `Timeline.note` at every change of a (tier, kind) count with
the count's new value; the engine names the phase as it goes (`ledger.phase`: "forward <unit>",
"backward", "step", and "io wait" while a weight shard's NVMe read is waited for). A step's
events are kept from its first change to `end_step` (the engine's boundary step), which makes
them the last complete step's timeline and starts the next one from a snapshot of every count.
Recording is one tuple append per allocation or release (a step has a few per unit), so it is
always on; a step that never ends (an evaluation loop of forwards) stops at MAX_EVENTS.

The process's measured RSS runs beside the counts: the RSS watch's thread (engine/host_budget.py
RssWatch, 20 samples a second) appends (seconds since the start, phase, bytes) to the current
step with `note_rss`, one tuple append per sample, bounded by MAX_RSS_SAMPLES. The gap between
it and the ledger's counts of the tiers in process memory (`rss_tiers`: host, and device on a
CPU-only run) is memory the ledger does not count: the interpreter and libraries, the
allocator's slack, the idle scratch buffers (which count against a budget but under no kind),
and anything allocated behind the ledger's back. The thread and the step switch in `end_step`
share the (step, start time) pair as one attribute, so a sample lands in one step, timed from
that step's start; one taken as the step ends may land at the end of the step just kept.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

MAX_EVENTS = 200_000
MAX_RSS_SAMPLES = 36_000  # 30 minutes at the RSS watch's 20 a second


@dataclass
class MemoryTimeline:
    """One step: `start` counts per (tier, kind) as it began, then `events` (seconds since the
    start, phase, tier, kind, the count's new bytes); an event with tier None marks where a
    phase began (a forward that allocates nothing still shows). `rss`: the process's RSS as
    sampled (seconds since the start, phase, bytes), to read against the ledger's `rss_tiers`."""

    start: dict[tuple[str, str], int] = field(default_factory=dict)
    events: list[tuple[float, str, str, str, int]] = field(default_factory=list)
    truncated: bool = False
    rss: list[tuple[float, str, int]] = field(default_factory=list)
    rss_tiers: tuple[str, ...] = ("host",)

    def totals(self) -> list[tuple[float, str, dict[str, dict[str, int]]]]:
        """After each event: (time, phase, tier -> kind -> bytes), every count at that moment."""
        now = dict(self.start)
        out = []
        for t, phase, tier, kind, nbytes in self.events:
            if tier is not None:
                now[(tier, kind)] = nbytes
            table: dict[str, dict[str, int]] = {}
            for (ti, ki), v in now.items():
                table.setdefault(ti, {})[ki] = v
            out.append((t, phase, table))
        return out

    def peak(self, tier: str) -> int:
        """The most bytes `tier` held at once during the step."""
        return max((sum(table.get(tier, {}).values()) for _, _, table in self.totals()),
                   default=sum(v for (t, _), v in self.start.items() if t == tier))

    def rss_peak(self) -> tuple[int, str] | None:
        """The most RSS sampled in the step and the phase it was in; None without samples (a
        step shorter than the sampling interval, a file written before RSS was recorded)."""
        if not self.rss:
            return None
        _, phase, nbytes = max(self.rss, key=lambda s: s[2])
        return nbytes, phase

    def to_dict(self) -> dict:
        return {"start": [[t, k, v] for (t, k), v in self.start.items()],
                "events": [list(e) for e in self.events], "truncated": self.truncated,
                "rss": [list(s) for s in self.rss], "rss_tiers": list(self.rss_tiers)}

    @classmethod
    def from_dict(cls, data: dict) -> "MemoryTimeline":
        """`data` as to_dict wrote it; a file from before the RSS series loads with none."""
        return cls({(t, k): v for t, k, v in data["start"]},
                   [tuple(e) for e in data["events"]], data.get("truncated", False),
                   [tuple(s) for s in data.get("rss", [])], tuple(data.get("rss_tiers", ("host",))))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f)

    @classmethod
    def load(cls, path: str) -> "MemoryTimeline":
        with open(path) as f:
            return cls.from_dict(json.load(f))


class Timeline:
    """The recorder the ledger owns: the current step's events and the last complete step's."""

    def __init__(self) -> None:
        self.phase = "idle"
        self.rss_tiers: tuple[str, ...] = ("host",)
        # (the step being recorded, its start): replaced whole, read once by each recorder
        self._live = (MemoryTimeline(), time.perf_counter())
        self.last: MemoryTimeline | None = None

    def note(self, tier: str, kind: str, nbytes: int) -> None:
        step, t0 = self._live
        if len(step.events) >= MAX_EVENTS:
            step.truncated = True
            return
        step.events.append((time.perf_counter() - t0, self.phase, getattr(tier, "value", tier),
                            kind, nbytes))

    def note_rss(self, nbytes: int) -> None:
        """One RSS sample, from the RSS watch's thread (see the note above)."""
        step, t0 = self._live
        if len(step.rss) >= MAX_RSS_SAMPLES:
            step.truncated = True
            return
        step.rss.append((time.perf_counter() - t0, self.phase, nbytes))

    def set_phase(self, name: str) -> None:
        """What the rank does from now on; marked in the events where it changes."""
        if name != self.phase:
            self.phase = name
            step, t0 = self._live
            if len(step.events) < MAX_EVENTS:
                step.events.append((time.perf_counter() - t0, name, None, None, None))

    def set_rss_tiers(self, tiers: tuple[str, ...]) -> None:
        """The ledger's tiers that live in the process's memory, which the RSS is read against
        (the RSS watch's: host, and device on a CPU-only run)."""
        self.rss_tiers = tuple(str(getattr(t, "value", t)) for t in tiers)
        self._live[0].rss_tiers = self.rss_tiers

    def end_step(self, counts: dict) -> None:
        """The step ended: keep it, start the next one from `counts` ((tier, kind) -> bytes)."""
        self.last = self._live[0]
        self._live = (MemoryTimeline(self._snapshot(counts), rss_tiers=self.rss_tiers),
                      time.perf_counter())

    def current(self) -> MemoryTimeline:
        return self._live[0]

    @staticmethod
    def _snapshot(counts: dict) -> dict[tuple[str, str], int]:
        return {(str(getattr(t, "value", t)), k): v for (t, k), v in counts.items()}
