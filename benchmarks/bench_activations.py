#!/usr/bin/env python
"""Activation memory (ZeRO-R): peak memory and step time of the demo GPT at a sequence length
where activations dominate, with zerokit.activations, deepspeed.checkpointing and
torch.utils.checkpoint.

    flock /tmp/zk-heavy.lock .venv/bin/python benchmarks/bench_activations.py
    python benchmarks/bench_activations.py --only none,zk-plain,zk-cpu --steps 3

Each row is its own `torchrun --standalone` job (one intra-op thread per rank) that trains the
demo GPT (4 layers, width 192, seq 1024, micro-batch 2, AdamW, fp32, fixed-seed random bytes)
as a plain torch loop: only the checkpoint function differs between rows. Every block is
checkpointed (zerokit: apply_activation_checkpointing; DeepSpeed and torch: the block's forward
replaced by checkpoint(forward, x), the same wrapping). Rows with partitioned activations run 2
ranks forming one model-parallel group (an mpu over the world) that trains identical copies on
the same batch, as a tensor-parallel group's ranks hold identical block inputs; every other row
runs 1 rank.

Measured per row: the median step time (forward + backward + optimizer) over the timed steps;
the peak RSS minus the RSS before the model was built (ru_maxrss; on a CPU-only machine host
offload moves bytes between two parts of the same RAM, so RSS cannot show it); for zerokit rows,
the ledger's peak checkpointed-activation bytes per tier ("device" is the CPU here, as for model
states), which is what host offload frees on a machine with a GPU. Everything goes to
benchmarks/results/bench_activations-<time>.json (and -latest.json).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

# name -> (library, options, ranks, label)
ROWS: dict[str, tuple[str, dict, int, str]] = {
    "none": ("none", {}, 1, "no checkpointing"),
    "torch": ("torch", {}, 1, "torch.utils.checkpoint (non-reentrant)"),
    "zk-plain": ("zerokit", {}, 1, "zerokit checkpoint"),
    "zk-cpu": ("zerokit", {"checkpoint_in_cpu": True}, 1, "zerokit cpu_checkpointing"),
    "zk-part": ("zerokit", {"partition_activations": True}, 2, "zerokit partition_activations (mp 2)"),
    "ds-plain": ("deepspeed", {}, 1, "deepspeed.checkpointing"),
    "ds-cpu": ("deepspeed", {"checkpoint_in_cpu": True}, 1, "deepspeed cpu_checkpointing"),
    "ds-part": ("deepspeed", {"partition_activations": True}, 2, "deepspeed partition_activations (mp 2)"),
}
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
              "PYTHONUNBUFFERED": "1"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None, help=f"comma-separated rows (default all: {', '.join(ROWS)})")
    p.add_argument("--steps", type=int, default=4, help="timed steps per row (default 4)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps (default 1)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--row-timeout", type=float, default=900.0)
    p.add_argument("--out", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ===================================================================================== worker
class Mpu:
    """Megatron's mpu over the whole world: the model-parallel group of the partitioned rows."""

    def get_model_parallel_group(self):
        import torch.distributed as dist
        return dist.group.WORLD

    def get_model_parallel_rank(self):
        import torch.distributed as dist
        return dist.get_rank()

    def get_model_parallel_world_size(self):
        import torch.distributed as dist
        return dist.get_world_size()

    get_data_parallel_rank = lambda self: 0  # noqa: E731  (DeepSpeed's configure asks for these)
    get_data_parallel_world_size = lambda self: 1  # noqa: E731


def _wrap_blocks(model, checkpoint) -> None:
    for block in model.transformer.h:
        block.forward = functools.partial(checkpoint, block.forward)


def _setup(library: str, options: dict, model, rec: dict):
    """Make the model checkpoint its blocks with `library`; returns a ledger (zerokit) or None."""
    mpu = Mpu() if options.get("partition_activations") else None
    if library == "zerokit":
        from zerokit import activations
        from zerokit.tiers import Ledger

        activations.configure(mpu, **options)
        ledger = Ledger()
        activations.use_ledger(ledger)
        activations.apply_activation_checkpointing(model)
        return ledger
    if library == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        deepspeed.activations.configure(mpu, **options)
        _wrap_blocks(model, deepspeed.activations.checkpoint)
    elif library == "torch":
        from torch.utils.checkpoint import checkpoint

        _wrap_blocks(model, functools.partial(checkpoint, use_reentrant=False))
    return None


def run_worker(args) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    library, options, _ranks, label = ROWS[args.worker]
    rec: dict = {"row": args.worker, "label": label, "rank": rank, "status": "ok"}
    out = Path(args.result_dir) / f"rank{rank}.json"
    try:
        dist.init_process_group("gloo")
        from zerokit.models import GPT, GPTConfig

        if library == "deepspeed":  # its import footprint is not activation memory
            import deepspeed  # noqa: F401
        rec["rss_baseline_mb"] = C.current_rss_mb()
        torch.manual_seed(args.seed)  # the same weights in every row and on every rank
        model = GPT(GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                              block_size=args.seq, vocab_size=256))
        ledger = _setup(library, options, model, rec)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        g = torch.Generator().manual_seed(args.seed + 1)  # the same batch on every rank
        toks = [torch.randint(0, 256, (args.micro_batch, args.seq + 1), generator=g)
                for _ in range(args.warmup + args.steps)]
        times, losses = [], []
        for i, t in enumerate(toks):
            x, y = t[:, :-1].contiguous(), t[:, 1:].contiguous()
            dist.barrier()
            t0 = C.now()
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= args.warmup:
                times.append(C.now() - t0)
            losses.append(float(loss.detach()))
        rec["step_s"] = times
        rec["losses"] = losses
        if ledger is not None:
            rec["ledger_peak_activations"] = {tier: ledger.bytes(tier, "activations", peak=True)
                                              for tier in ("device", "host")}
    except BaseException as e:  # report, so the parent prints the row as failed
        rec["status"] = "error"
        rec["reason"] = f"{type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc()
    rec["peak_rss_mb"] = C.peak_rss_mb()
    out.write_text(json.dumps(rec, indent=1) + "\n")
    return 0 if rec["status"] == "ok" else 1


# ===================================================================================== parent
def run_row(name: str, args, log_dir: Path) -> dict:
    library, options, ranks, label = ROWS[name]
    res: dict = {"row": name, "label": label, "library": library, "options": options, "ranks": ranks}
    forwarded = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--layers", str(args.layers),
                 "--width", str(args.width), "--heads", str(args.heads), "--seq", str(args.seq),
                 "--micro-batch", str(args.micro_batch), "--seed", str(args.seed)]
    with tempfile.TemporaryDirectory(prefix=f"zk-bench-act-{name}-") as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
               f"--nproc-per-node={ranks}", str(Path(__file__).resolve()), "--worker", name,
               "--result-dir", tmp, *forwarded]
        log_path = log_dir / f"bench_activations-{name}.log"
        try:
            with open(log_path, "w") as log:
                rc = subprocess.run(cmd, env={**os.environ, **WORKER_ENV}, stdout=log,
                                    stderr=subprocess.STDOUT, timeout=args.row_timeout,
                                    cwd=C.REPO_ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        recs = [json.loads(f.read_text()) for f in sorted(Path(tmp).glob("rank*.json"))]
    res["returncode"] = rc
    bad = [r for r in recs if r["status"] != "ok"]
    if rc != 0 or len(recs) != ranks or bad:
        res["status"] = "error"
        res["reason"] = bad[0]["reason"] if bad else f"torchrun exit {rc}; see {log_path}"
        return res
    res["status"] = "ok"
    res["step_s"] = C.summarize(C.elementwise_max([r["step_s"] for r in recs]))
    res["losses"] = recs[0]["losses"]
    res["peak_rss_mb"] = max(r["peak_rss_mb"] for r in recs)
    res["peak_minus_baseline_mb"] = max(r["peak_rss_mb"] - r["rss_baseline_mb"] for r in recs)
    if "ledger_peak_activations" in recs[0]:
        res["ledger_peak_activations"] = recs[0]["ledger_peak_activations"]
    return res


def _table(results: list[dict], args) -> str:
    layer_mb = args.micro_batch * args.seq * args.width * 4 / C.MB
    base = next((r for r in results if r["row"] == "zk-plain" and r["status"] == "ok"), None)
    rows = []
    for r in results:
        if r["status"] != "ok":
            rows.append([r["row"], f"{r['label']}: error: {r['reason'][:70]}", r["ranks"], "", "", "",
                         "", ""])
            continue
        led = r.get("ledger_peak_activations")
        step = r["step_s"]["median"]
        rows.append([r["row"], r["label"], r["ranks"], C.fmt_num(step, ".3f"),
                     C.fmt_num(C.ratio(step, base["step_s"]["median"]) if base else None, ".2f", "x"),
                     C.fmt_num(r["peak_minus_baseline_mb"], ".1f"),
                     C.fmt_num(led["device"] / C.MB, ".2f") if led else "",
                     C.fmt_num(led["host"] / C.MB, ".2f") if led else ""])
    head = ["row", "what", "ranks", "step s", "vs zk-plain", "peak RSS - base MiB",
            "ckpt device MiB", "ckpt host MiB"]
    return (C.format_table(head, rows) + f"\none layer's checkpointed input: {layer_mb:.2f} MiB "
            f"({args.layers} layers)")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    names = list(ROWS) if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; rows: {', '.join(ROWS)}")
    log_dir = C.results_dir("logs")
    results = []
    for name in names:
        print(f"running {name} ...", flush=True)
        results.append(run_row(name, args, log_dir))
    table = _table(results, args)
    print(table)
    path = C.write_json("bench_activations", {"machine": C.machine_info(), "args": vars(args),
                                              "results": results, "table": table}, args.out)
    print(f"wrote {path}")
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
