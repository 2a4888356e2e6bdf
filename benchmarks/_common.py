"""Helpers shared by the benchmarks: timing stats, memory, machine description, tables, JSON.

Nothing here imports zerokit or deepspeed, so a benchmark's parent process stays light and a
benchmark can describe the machine even when a library under test is missing.
"""
from __future__ import annotations

import datetime as _dt
import importlib.metadata as _md
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"  # git-ignored

MB = 1024.0 * 1024.0


# --------------------------------------------------------------------------------------- timing
def now() -> float:
    """Monotonic high-resolution clock, in seconds."""
    return time.perf_counter()


def summarize(xs: Sequence[float]) -> dict[str, float]:
    """median / mean / min / max / stdev / n of a list of numbers (empty dict for no numbers)."""
    xs = [float(x) for x in xs]
    if not xs:
        return {}
    return {
        "median": statistics.median(xs),
        "mean": statistics.fmean(xs),
        "min": min(xs),
        "max": max(xs),
        "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0,
        "n": len(xs),
    }


def elementwise_max(rows: Sequence[Sequence[float]]) -> list[float]:
    """Per-index max over several equally long lists (e.g. a step's time over ranks: the slowest
    rank sets the pace of a synchronous step)."""
    if not rows:
        return []
    n = min(len(r) for r in rows)
    return [max(r[i] for r in rows) for i in range(n)]


# --------------------------------------------------------------------------------------- memory
def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB (Linux reports ru_maxrss in KiB)."""
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return ru / 1024.0 if sys.platform != "darwin" else ru / MB


def take_rss_high_water_mb() -> float | None:
    """The resident high-water mark since the last call (Linux VmHWM), then reset to the current
    RSS (writing 5 to /proc/self/clear_refs), so each phase of a run gets its own peak; None where
    the kernel does not offer it. The reset lowers ru_maxrss too (getrusage reads the same mark):
    a caller that resets takes its run's peak as the largest of the phases' peaks."""
    try:
        with open("/proc/self/status") as f:
            hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except (OSError, StopIteration, ValueError):
        return None
    return hwm / 1024.0


def current_rss_mb() -> float:
    """This process's resident set size now, in MiB (psutil; falls back to /proc)."""
    try:
        import psutil

        return psutil.Process().memory_info().rss / MB
    except ImportError:  # pragma: no cover - psutil is a zerokit dependency
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


# -------------------------------------------------------------------------------------- machine
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, memory, software versions, repo commit."""
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "hostname": platform.node(),
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        import psutil

        info["mem_total_gib"] = round(psutil.virtual_memory().total / (1024**3), 2)
        info["physical_cores"] = psutil.cpu_count(logical=False)
    except ImportError:  # pragma: no cover
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except ImportError:  # pragma: no cover
        info["torch"] = None
    for dist in ("deepspeed", "zerokit", "numpy"):
        info[dist] = _version(dist)
    commit = _git("rev-parse", "HEAD")
    if commit:
        info["git_commit"] = commit
        info["git_dirty"] = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return info


# ---------------------------------------------------------------------------------------- table
def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain-text table; numbers right-aligned, everything else left-aligned."""
    rows = [["" if c is None else c for c in r] for r in rows]
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [
        all(_is_num(r[i]) for r in rows if r[i] != "") and any(r[i] != "" for r in rows)
        for i in range(len(headers))
    ]

    def fmt(r: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)).rstrip()

    lines = [fmt(cells[0]), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in cells[1:]]
    return "\n".join(lines)


def _is_num(x: Any) -> bool:
    if isinstance(x, (int, float)):
        return True
    s = str(x).rstrip("x%")
    try:
        float(s)
        return True
    except ValueError:
        return False


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt_num(x: float | None, spec: str = ".3f", suffix: str = "") -> str:
    return "" if x is None else f"{x:{spec}}{suffix}"


# ----------------------------------------------------------------------------------------- JSON
def timestamp() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def results_dir(*sub: str) -> Path:
    """benchmarks/results (or a folder under it), created if missing: a fresh clone has none."""
    path = RESULTS_DIR.joinpath(*sub)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(name: str, payload: dict[str, Any], out: str | os.PathLike | None = None) -> Path:
    """Write `payload` to `out`, or to benchmarks/results/<name>-<timestamp>.json and also to
    benchmarks/results/<name>-latest.json. Returns the timestamped (or given) path."""
    if out is not None:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
        return path
    path = results_dir() / f"{name}-{timestamp()}.json"
    text = json.dumps(payload, indent=2, sort_keys=False) + "\n"
    path.write_text(text)
    (RESULTS_DIR / f"{name}-latest.json").write_text(text)
    return path


def merge_rounds(names: list[str], rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """One result per row: the last round's, its times the median of the rounds' medians (the
    rounds' own medians kept in "step_s_rounds"), min / max / peak RSS over every round."""
    import statistics

    merged = {}
    for name in names:
        runs = [r[name] for r in rounds]
        ok = [r for r in runs if r["status"] == "ok"]
        if len(ok) < len(runs):
            merged[name] = next(r for r in runs if r["status"] != "ok")
            continue
        res = dict(ok[-1])
        res["step_s_rounds"] = [r["step_s"]["median"] for r in ok]
        for part in ("step_s", "forward_s", "backward_s", "optimizer_s"):
            res[part] = dict(res[part], median=statistics.median(r[part]["median"] for r in ok),
                             min=min(r[part]["min"] for r in ok), max=max(r[part]["max"] for r in ok))
        res["peak_rss_mb"] = max(r["peak_rss_mb"] for r in ok)
        merged[name] = res
    return merged
