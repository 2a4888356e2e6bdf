"""The estimator's table: one row per stage and offload choice, bytes per rank per tier."""
from __future__ import annotations

from zerokit.memory.estimate import Estimate

GiB = 1 << 30


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def format_grid(estimates: list[Estimate], title: str) -> str:
    """The rows of `estimate_grid`: device (model states + activations), host, nvme per rank."""
    head = (f"{'config':<36}{'device':>12}{'(activations)':>15}{'host':>12}{'nvme':>12}")
    lines = [title, head]
    for e in estimates:
        act = e.bytes["device"]["activations"]
        lines.append(f"{e.label:<36}{_size(e.tier('device')):>12}{_size(act):>15}"
                     f"{_size(e.tier('host')):>12}{_size(e.tier('nvme')):>12}")
    if estimates:
        lines.append(f"per rank of {estimates[0].world_size}; {estimates[0].params:,} parameters; "
                     f"{estimates[0].activation_note or 'activations not measured'}")
    return "\n".join(lines)


def format_one(e: Estimate) -> str:
    """Every tier and kind of one estimate, as the ledger's table reads."""
    kinds = list(next(iter(e.bytes.values())))
    lines = [f"{e.label}, per rank of {e.world_size}",
             f"{'tier':<8}" + "".join(f"{k:>17}" for k in kinds) + f"{'total':>12}"]
    for tier, row in e.bytes.items():
        if any(row.values()):
            lines.append(f"{str(tier.value if hasattr(tier, 'value') else tier):<8}"
                         + "".join(f"{_size(v):>17}" for v in row.values())
                         + f"{_size(sum(row.values())):>12}")
    return "\n".join(lines)
