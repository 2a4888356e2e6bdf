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


def ledger_ram_peak(engine) -> dict | None:
    """The most RAM the engine's ledger counted at once in the last step (host and, on a CPU
    device, device tiers together, idle scratch buffers left out), with the phase and the
    counts per kind at that moment: set beside the measured RSS peaks it shows what the byte
    rules miss. None for an engine without a ledger (DeepSpeed)."""
    ledger = getattr(engine, "ledger", None)
    if ledger is None:
        return None
    best = None
    for _, phase, table in ledger.last_step_timeline().totals():
        ram = {f"{tier}:{kind}": v for tier, kinds in table.items() if tier != "nvme"
               for kind, v in kinds.items() if v}
        total = sum(ram.values())
        if best is None or total > best[0]:
            best = (total, phase, ram)
    if best is None:
        return None
    mib = 1 << 20
    return {"mib": round(best[0] / mib), "phase": best[1],
            "kinds_mib": {k: round(v / mib) for k, v in sorted(best[2].items())}}
