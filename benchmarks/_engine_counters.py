"""What a benchmark reads from an engine after each step, where the library has it: zerokit's disk
idle time (engine.nvme_io()) and the speculative step's counters (engine.speculation); None for
an engine without them (DeepSpeed, or a zerokit without speculation), printed as "n/a".
"""
from __future__ import annotations


def disk_idle(engine) -> dict | None:
    """zerokit's report of the step's disk idle time (engine.nvme_io()), or None (DeepSpeed).
    With accumulation the report covers the boundary micro-step's window: since the previous
    boundary, so the whole step."""
    io = getattr(engine, "nvme_io", lambda: {})()
    if "idle_s" not in io:
        return None
    return {k: round(io[k], 3) for k in ("idle_s", "read_idle_s", "write_idle_s", "window_s")}


def speculation(engine) -> dict | None:
    """The speculative step's counters (engine.speculation, issue #26's points 1-5), if this
    engine has them: steps committed, redone, skipped, and the redo's seconds so far."""
    spec = getattr(engine, "speculation", None)
    if spec is None:
        return None
    return {k: float(getattr(spec, k, 0) or 0) for k in ("committed", "redone", "skipped", "redo_s")}


def redo(before: dict | None, after: dict | None) -> dict | None:
    """What this step added to the counters."""
    if before is None or after is None:
        return None
    return {k: round(after[k] - before[k], 3) for k in after}
