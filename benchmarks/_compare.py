"""Two trees side by side: the zerokit rows of a benchmark run against this checkout and against
an earlier revision, alternating, so that a change's cost shows as a ratio in its note.

    python benchmarks/bench_step.py --compare HEAD~3 --rounds 3

The other revision is checked out into a temporary git worktree (removed at the end); its native
extensions are copied from this checkout when the C++ sources and setup.py are the same in both,
and built there otherwise (`setup.py build_ext --inplace`). Every row runs with the same harness
(this checkout's benchmark script); only `PYTHONPATH` says which zerokit the ranks import. Round k
runs the trees in the order (this, other) when k is even and (other, this) when odd, so drift of
the machine during the run falls on both sides; the table gives the median of the rounds'
medians, and of the rounds' peak RSS (the largest rank's ru_maxrss).
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import _common as C

NATIVE_INPUTS = ("src/zerokit/csrc", "setup.py")


def _git(*args: str, cwd: Path = C.REPO_ROOT) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"--compare: git {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout.strip()


@contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """A worktree of `rev` with its native extensions in place; removed on exit."""
    sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    tmp = Path(tempfile.mkdtemp(prefix="zk-compare-"))
    tree = tmp / sha[:12]
    _git("worktree", "add", "--detach", str(tree), sha)
    try:
        same_native = subprocess.run(["git", "diff", "--quiet", sha, "--", *NATIVE_INPUTS],
                                     cwd=C.REPO_ROOT).returncode == 0
        built = list((C.REPO_ROOT / "src").rglob("*.so"))
        if same_native and built:
            for so in built:
                dest = tree / so.relative_to(C.REPO_ROOT)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(so, dest)
        else:
            print(f"--compare: building {rev}'s native extensions", flush=True)
            subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree,
                           check=True, stdout=subprocess.DEVNULL)
        yield tree
    finally:
        _git("worktree", "remove", "--force", str(tree))
        shutil.rmtree(tmp, ignore_errors=True)


def compare(rev: str, names: list[str], rounds: int,
            run_row: Callable[[str, dict[str, str]], dict]) -> tuple[str, dict]:
    """Run `names` against this tree and `rev`, `rounds` times alternating; `run_row(name, env)`
    runs one row with `env` added to its ranks' environment and returns its result record.
    Returns the table and the JSON payload."""
    this = C.REPO_ROOT / "src"
    medians: dict[str, dict[str, list[float]]] = {"this": {n: [] for n in names},
                                                  "other": {n: [] for n in names}}
    rss: dict[str, dict[str, list[float]]] = {"this": {n: [] for n in names},  # peak per round
                                              "other": {n: [] for n in names}}
    failures: list[str] = []
    with checkout(rev) as tree:
        trees = [("this", this), ("other", tree / "src")]
        for k in range(rounds):
            for side, src in (trees if k % 2 == 0 else trees[::-1]):
                for name in names:
                    r = run_row(name, {"PYTHONPATH": str(src)})
                    label = "this tree" if side == "this" else rev
                    if r["status"] != "ok":
                        failures.append(f"round {k + 1} {label} {name}: {r['status']}: {r.get('reason', '')}")
                        print(f"  {failures[-1]}", flush=True)
                        continue
                    ran = {rank.get("zerokit_file", "") for rank in r["ranks"]}
                    if not all(f.startswith(str(src)) for f in ran):
                        raise SystemExit(f"--compare: the {label} row {name} imported zerokit from "
                                         f"{sorted(ran)}, not {src}")
                    medians[side][name].append(r["step_s"]["median"])
                    rss[side][name].append(r["peak_rss_mb"])
                    print(f"  round {k + 1} {label:>12s} {name:6s} {r['step_s']['median']:.3f} s/step"
                          f"  peak RSS {r['peak_rss_mb']:.0f} MiB", flush=True)
    rows, payload = [], {"rev": rev, "rev_sha": _git("rev-parse", rev), "rounds": rounds, "rows": {}, "failures": failures}
    for name in names:
        a, b = medians["this"][name], medians["other"][name]
        ma = statistics.median(a) if a else None
        mb = statistics.median(b) if b else None
        ra, rb = rss["this"][name], rss["other"][name]
        mra = statistics.median(ra) if ra else None
        mrb = statistics.median(rb) if rb else None
        payload["rows"][name] = {"this_s": a, "other_s": b, "this_median": ma, "other_median": mb,
                                 "ratio_this_over_other": C.ratio(ma, mb),
                                 "this_peak_rss_mb": ra, "other_peak_rss_mb": rb}
        rows.append([name, C.fmt_num(ma), C.fmt_num(mb), C.fmt_num(C.ratio(ma, mb), ".3f", "x"),
                     C.fmt_num(mra, ".0f"), C.fmt_num(mrb, ".0f"),
                     " ".join(f"{x:.3f}" for x in a), " ".join(f"{x:.3f}" for x in b)])
    table = C.format_table(["row", "this tree s/step", f"{rev} s/step", "this / other",
                            "this peak RSS MiB", f"{rev} peak RSS MiB",
                            "this, per round", "other, per round"], rows)
    return table, payload
