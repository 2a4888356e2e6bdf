"""`zerokit plot`: a step's memory timeline (tiers/timeline.py) as a PNG.

One panel per tier that held bytes, the ledger's kinds stacked over the step's time, the
phases (forward, backward, step, I/O waits) as shaded bands. Where the RSS watch sampled the
step, a last panel draws the process's RSS as a line over the ledger's totals of the tiers in
process memory (host; device too on a CPU-only run), the gap between them shaded: memory the
ledger does not count ([Note: the memory timeline] in tiers/timeline.py). matplotlib is the
optional extra `plot` (`pip install 'zerokit[plot]'`); without it the error says so.
"""
from __future__ import annotations

from bisect import bisect_right

from zerokit.tiers.ledger import KINDS
from zerokit.tiers.timeline import MemoryTimeline

_BANDS = {"forward": "#dbe9f6", "recompute": "#e6dbf6", "backward": "#f6e3db", "step": "#dbf6de",
          "io wait": "#f6f3c4", "idle": "#ffffff"}


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("drawing the memory timeline needs matplotlib, the optional extra 'plot': "
                          "pip install 'zerokit[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _coarse(phase: str) -> str:
    return phase.split(" ", 1)[0] if not phase.startswith("io wait") else "io wait"


def plot_timeline(timeline: MemoryTimeline, out: str, title: str = "memory timeline") -> str:
    """Write `timeline` as a PNG at `out`; returns `out`."""
    plt = _matplotlib()
    points = timeline.totals()
    if not points:
        raise ValueError("the memory timeline has no events: run at least one training step "
                         "(forward, backward, step) before plotting it")
    tiers = [t for t in ("device", "host", "nvme")
             if any(sum(table.get(t, {}).values()) for _, _, table in points)]
    times = [t for t, _, _ in points]
    panels = len(tiers) + bool(timeline.rss)
    fig, axes = plt.subplots(panels, 1, figsize=(11, 3 * panels), sharex=True, squeeze=False)
    if timeline.rss:
        _rss_panel(axes[-1, 0], timeline, points)
    for ax, tier in zip(axes[:, 0], tiers):
        _bands(ax, points)
        stacks = [[table.get(tier, {}).get(k, 0) / 2**20 for _, _, table in points] for k in KINDS]
        ax.stackplot(times, *stacks, labels=KINDS, step="post", alpha=0.85)
        peak = max(sum(table.get(tier, {}).values()) for _, _, table in points)
        ax.set_ylabel(f"{tier} (MiB)")
        ax.set_title(f"{tier}: peak {peak / 2**20:,.1f} MiB", fontsize=9, loc="left")
        ax.legend(loc="upper right", fontsize=7, ncol=3)
    axes[-1, 0].set_xlabel("seconds into the step (shaded: forward, backward, step, io wait)")
    fig.suptitle(title + (" (truncated)" if timeline.truncated else ""))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _bands(ax, points) -> None:
    """Shade each run of one coarse phase, labelled once where it starts."""
    start, phase = points[0][0], _coarse(points[0][1])
    labelled: set[str] = set()
    for t, p, _ in points[1:] + [(points[-1][0], None, None)]:
        here = _coarse(p) if p is not None else None
        if here != phase:
            ax.axvspan(start, t, color=_BANDS.get(phase, "#eeeeee"), zorder=0,
                       label=None if phase in labelled else None)
            if phase not in labelled:
                ax.annotate(phase, (start, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                            va="top", color="#555555")
                labelled.add(phase)
            start, phase = t, here


def _rss_panel(ax, timeline: MemoryTimeline, points) -> None:
    """The sampled RSS over the ledger's totals of `timeline.rss_tiers`, stacked per tier."""
    _bands(ax, points)
    times = [t for t, _, _ in points]
    tiers = list(timeline.rss_tiers)
    stacks = [[sum(table.get(tier, {}).values()) / 2**20 for _, _, table in points] for tier in tiers]
    ax.stackplot(times, *stacks, labels=[f"ledger: {t}" for t in tiers], step="post", alpha=0.6)
    rss_t = [t for t, _, _ in timeline.rss]
    rss = [n / 2**20 for _, _, n in timeline.rss]
    # the ledger's total as each sample was taken: the last event at or before it
    counted = [sum(stack[max(0, bisect_right(times, t) - 1)] for stack in stacks) for t in rss_t]
    ax.fill_between(rss_t, counted, rss, where=[r > c for r, c in zip(rss, counted)], color="#d62728",
                    alpha=0.15, label="RSS not counted by the ledger")
    ax.plot(rss_t, rss, color="#d62728", linewidth=1.2, label="process RSS (sampled)")
    peak, phase = timeline.rss_peak()
    ax.set_ylabel("process (MiB)")
    ax.set_title(f"process RSS against the ledger's {' + '.join(tiers)}: peak "
                 f"{peak / 2**20:,.1f} MiB ({phase})", fontsize=9, loc="left")
    ax.legend(loc="upper right", fontsize=7, ncol=2)
