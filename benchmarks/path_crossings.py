#!/usr/bin/env python
"""How many files one gradient's path crosses (issue #26 point 6: "halve the crossings").

    .venv/bin/python benchmarks/path_crossings.py                    # this tree
    .venv/bin/python benchmarks/path_crossings.py --compare 5b0115f  # beside another revision

A model that is one unit holding one weight (a 256 x 256 Linear) trains on one process at stage
3 with its optimizer on NVMe; after two warm-up steps, every Python call into zerokit's files from
`engine.backward` to the end of `engine.step()` is recorded, per thread (the I/O and step workers
too). With one unit and one weight, every call on the way serves that gradient: from the backward
hook through the reduction, the held gradient or gradient file, the NVMe stream and the host
kernel, back to the weight. The table says, per variant (the step in step(), and stepped in
backward), the files the calls cross and how often consecutive calls change file (summed over
threads). The I/O engine (io/) and the kernel's pure-torch fallback (optim/fallback.py) are left
out: they are leaves whose call counts depend on whether the native extension is built, not on
the path. --compare REV runs the same trace in a temporary worktree of REV (no native extension
there, which the leaves' exclusion makes irrelevant) and prints both. Writes
benchmarks/results/path_crossings-<time>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

VARIANTS = {"step": False, "sib": True}  # name -> offload_optimizer.step_in_backward
LEAVES = ("io/", "optim/fallback.py")
ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
       "MASTER_PORT": "29561", "OMP_NUM_THREADS": "1"}


def trace(variant: str) -> dict:
    """Run in a worker process: the calls of one traced step, per thread."""
    import threading

    import torch
    import zerokit

    root = os.path.dirname(zerokit.__file__) + os.sep
    on, calls = [False], {}

    def prof(frame, event, arg):
        if on[0] and event == "call" and frame.f_code.co_filename.startswith(root):
            calls.setdefault(threading.get_ident(), []).append(frame.f_code.co_filename[len(root):])

    threading.setprofile(prof)  # the workers the engine starts from here on
    with tempfile.TemporaryDirectory(prefix="zk-crossings-") as swap:
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": 3, "offload_optimizer": {
                   "device": "nvme", "nvme_path": swap, "step_in_backward": VARIANTS[variant]}}}
        torch.manual_seed(0)
        engine = zerokit.initialize(model=torch.nn.Linear(256, 256, bias=False), config=cfg)[0]
        x = torch.randn(4, 256)
        for _ in range(2):
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
        loss = engine(x).float().pow(2).mean()
        on[0] = True
        sys.setprofile(prof)
        engine.backward(loss)
        engine.step()
        sys.setprofile(None)
        on[0] = False
        threading.setprofile(None)
        del engine
    return {t: seq for t, seq in calls.items()}


def count(calls: dict) -> dict:
    seqs = [[f for f in seq if not f.startswith(LEAVES)] for seq in calls.values()]
    files = Counter(f for seq in seqs for f in seq)
    return {"files": len(files), "changes": sum(sum(a != b for a, b in zip(s, s[1:])) for s in seqs),
            "calls": sum(files.values()), "by_file": dict(files.most_common())}


def run_tree(src: Path, variant: str) -> dict:
    """One variant in a fresh process importing zerokit from `src`."""
    env = {**os.environ, **ENV, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, __file__, "--worker", variant], env=env, text=True,
                         capture_output=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{src} {variant}: exit {out.returncode}\n{out.stderr[-2000:]}")
    return count(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", default=None, metavar="REV", help="also trace this revision")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(trace(args.worker)))
        return 0
    repo = Path(__file__).resolve().parent.parent
    trees = {"this tree": repo / "src"}
    with tempfile.TemporaryDirectory(prefix="zk-crossings-rev-") as tmp:
        if args.compare:
            subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", tmp, args.compare],
                           check=True, capture_output=True)
            trees[args.compare] = Path(tmp) / "src"
        try:
            rows = [{"tree": name, "variant": v, **run_tree(src, v)}
                    for name, src in trees.items() for v in VARIANTS]
        finally:
            if args.compare:
                subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", tmp],
                               capture_output=True)
    print(f"{'tree':<12} {'variant':<8} {'files':>5} {'changes':>7} {'calls':>6}")
    for r in rows:
        print(f"{r['tree']:<12} {r['variant']:<8} {r['files']:>5} {r['changes']:>7} {r['calls']:>6}")
    path = C.write_json("path_crossings", {"benchmark": "path_crossings", "argv": sys.argv[1:],
                                           "leaves_left_out": LEAVES, "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
