"""The memory timeline: bytes per tier and kind through a step, with the phase they changed in.

[Note: the memory timeline]
The ledger (tiers/ledger.py) calls `Timeline.note` at every change of a (tier, kind) count with
the count's new value; the engine names the phase as it goes (`ledger.phase`: "forward <unit>",
"backward", "step", and "io wait" while a weight shard's NVMe read is waited for). A step's
events are kept from its first change to `end_step` (the engine's boundary step), which makes
them the last complete step's timeline and starts the next one from a snapshot of every count.
Recording is one tuple append per allocation or release (a step has a few per unit), so it is
always on; a step that never ends (an evaluation loop of forwards) stops at MAX_EVENTS.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

MAX_EVENTS = 200_000


@dataclass
class MemoryTimeline:
    """One step: `start` counts per (tier, kind) as it began, then `events` (seconds since the
    start, phase, tier, kind, the count's new bytes); an event with tier None marks where a
    phase began (a forward that allocates nothing still shows)."""

    start: dict[tuple[str, str], int] = field(default_factory=dict)
    events: list[tuple[float, str, str, str, int]] = field(default_factory=list)
    truncated: bool = False

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

    def to_dict(self) -> dict:
        return {"start": [[t, k, v] for (t, k), v in self.start.items()],
                "events": [list(e) for e in self.events], "truncated": self.truncated}

    @classmethod
    def from_dict(cls, data: dict) -> "MemoryTimeline":
        return cls({(t, k): v for t, k, v in data["start"]},
                   [tuple(e) for e in data["events"]], data.get("truncated", False))

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
        self._step = MemoryTimeline()
        self._t0 = time.perf_counter()
        self.last: MemoryTimeline | None = None

    def note(self, tier: str, kind: str, nbytes: int) -> None:
        events = self._step.events
        if len(events) >= MAX_EVENTS:
            self._step.truncated = True
            return
        events.append((time.perf_counter() - self._t0, self.phase, getattr(tier, "value", tier),
                       kind, nbytes))

    def set_phase(self, name: str) -> None:
        """What the rank does from now on; marked in the events where it changes."""
        if name != self.phase:
            self.phase = name
            if len(self._step.events) < MAX_EVENTS:
                self._step.events.append((time.perf_counter() - self._t0, name, None, None, None))

    def end_step(self, counts: dict) -> None:
        """The step ended: keep it, start the next one from `counts` ((tier, kind) -> bytes)."""
        self.last = self._step
        self._step = MemoryTimeline(self._snapshot(counts))
        self._t0 = time.perf_counter()

    def current(self) -> MemoryTimeline:
        return self._step

    @staticmethod
    def _snapshot(counts: dict) -> dict[tuple[str, str], int]:
        return {(str(getattr(t, "value", t)), k): v for (t, k), v in counts.items()}
