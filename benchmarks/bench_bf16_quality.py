#!/usr/bin/env python
"""Training quality of bf16 master weights and optimizer states (issue #27): fp32 vs bf16, with
round-to-nearest and with stochastic rounding, in zerokit and in DeepSpeed.

    flock /tmp/zk-heavy.lock .venv/bin/python benchmarks/bench_bf16_quality.py     # every default row
    python benchmarks/bench_bf16_quality.py --steps 20 --rows zk-fp32,zk-bf16-rtn   # a quick check
    python benchmarks/bench_bf16_quality.py --lr 1e-3                                # where RTN keeps up

Every row trains the same built-in GPT (byte-level, vocab 256; default 4 layers x 256 wide, 4
heads, seq 128, micro-batch 8: 3.2M parameters) from the same initial weights (--seed) on the
same batches in the same order: windows of the Python standard library's own source (zerokit's
demo data, zerokit.data.stdlib_text / ByteDataset), drawn by a fixed-seed permutation. One
process per row, world size 1, --threads intra-op threads (default 2), bf16 compute, ZeRO stage
2 with offload_optimizer cpu (zerokit's host kernel; DeepSpeed's DeepSpeedCPUAdam), AdamW at a
constant learning rate, gradient_clipping 1.0. The rows:
  zk-fp32       zerokit, fp32 master + fp32 Adam moments (the reference)
  zk-bf16-rtn   zerokit, bf16.bf16_master_weights_and_grads + bf16_optimizer_states, round-to-nearest
  zk-bf16-sr    the same with zerokit's bf16.stochastic_rounding (seed bf16.stochastic_rounding_seed)
  zk-bf16m-rtn  zerokit, bf16 master, fp32 moments, round-to-nearest (where the loss goes)
  ds-fp32       DeepSpeed 0.19, fp32 master + fp32 moments (DeepSpeedCPUAdam)
  ds-bf16-rtn   DeepSpeed, bf16_master_weights_and_grads + bf16_optimizer_states, optimizer
                params fp32_optimizer_states=false (its CPU Adam rounds to nearest)
  ds-bf16-sr    DeepSpeed given zerokit's stochastic_rounding key: DeepSpeed has no such
                option, so the row reports what DeepSpeed says about it (its error text)
A row the library refuses at initialize is reported as "refused" with the library's own error.

The learning rate (default 1e-4) is chosen so that round-to-nearest visibly lags: a bf16 value
keeps 8 significant bits, so an update smaller than half an ulp of its weight rounds away. At
the GPT's init (std 0.02, LayerNorm weights 1.0) half an ulp is ~6e-5 (weights near 0.02) to
~2e-3 (LayerNorm weights); Adam's update is about lr x m/sqrt(v) <= lr, so at lr 1e-4 most
updates are below it and the bf16 master stalls. Stochastic rounding keeps every update in
expectation. Measured on a 2-core AMD EPYC (final loss vs fp32, held-out loss vs fp32 in ()):
  lr 1e-4,  300 steps: RTN +4.00% (+3.02%), SR -0.00% (-0.01%)
  lr 1e-3,  300 steps: RTN +0.65% (-0.00%), SR +0.73% (-0.03%)   (updates survive: no lag)
  lr 1e-4,  600 steps (the defaults, ~9 min for all rows): RTN +4.98% (+3.96%) in zerokit and
            in DeepSpeed alike, bf16 master with fp32 moments +4.95% (the master's rounding is
            what lags), SR +0.00% (-0.02%); the fp32 rows of both libraries agree to 0.008.

Reported per row: final loss = the mean training loss of the last --last-k steps (the same
batches in every row), that vs the same library's fp32 row in %, the held-out loss (--eval-batches
batches of the held-out 5% after training), the row's wall time (process start to end: imports,
setup, training, evaluation), the training loop's and its median s/step. The issue's bar:
zk-bf16-sr's final loss within 1% of zk-fp32's. Writes benchmarks/results/bench_bf16_quality-
<timestamp>.json (and -latest.json) with every row's loss curve and the machine description, and
bench_bf16_quality-<timestamp>.png (and -latest.png): all loss curves, smoothed (a moving mean
over --smooth steps), and below them each bf16 row minus its library's fp32 row (`--replot JSON`
draws it again from a result). The PNG needs matplotlib (zerokit's `plot` extra), imported only
there: without it the benchmark says so and writes the JSON only. Each row's output goes to
benchmarks/results/logs/.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

# name -> (library, bf16 master+grads, bf16 optimizer states, stochastic rounding, label)
ROWS: dict[str, tuple[str, bool, bool, bool, str]] = {
    "zk-fp32": ("zerokit", False, False, False, "zerokit fp32 master + fp32 states"),
    "zk-bf16-rtn": ("zerokit", True, True, False, "zerokit bf16 master + states, round-to-nearest"),
    "zk-bf16-sr": ("zerokit", True, True, True, "zerokit bf16 master + states, stochastic rounding"),
    "zk-bf16m-rtn": ("zerokit", True, False, False, "zerokit bf16 master, fp32 states, round-to-nearest"),
    "ds-fp32": ("deepspeed", False, False, False, "DeepSpeed fp32 master + fp32 states"),
    "ds-bf16-rtn": ("deepspeed", True, True, False, "DeepSpeed bf16 master + states (round-to-nearest)"),
    "ds-bf16-sr": ("deepspeed", True, True, True, "DeepSpeed bf16 master + states, stochastic rounding"),
}
DEFAULT_ROWS = ["zk-fp32", "zk-bf16-rtn", "zk-bf16-sr", "zk-bf16m-rtn", "ds-fp32", "ds-bf16-rtn", "ds-bf16-sr"]
BETAS, EPS, WEIGHT_DECAY, CLIPPING = [0.9, 0.999], 1e-8, 0.01, 1.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps per row (default 600)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate, constant (default 1e-4)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of each row's process")
    p.add_argument("--seed", type=int, default=1234, help="model init, batch order and rounding seed")
    p.add_argument("--last-k", type=int, default=None,
                   help="final loss = mean of the last k steps' losses (default: steps // 10, >= 1)")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches after training")
    p.add_argument("--smooth", type=int, default=None, help="moving-mean window of the plot "
                                                             "(default steps // 30, >= 1)")
    p.add_argument("--row-timeout", type=float, default=1800.0)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")
    p.add_argument("--replot", default=None, metavar="JSON", help="only draw the PNG of this result JSON again")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    args.last_k = max(1, args.last_k or args.steps // 10)
    args.smooth = max(1, args.smooth or args.steps // 30)
    if args.last_k > args.steps:
        p.error(f"--last-k {args.last_k} is more than --steps {args.steps}")
    return args


# ===================================================================================== worker
class Refused(Exception):
    """The library refused the configuration at initialize: reported with its own text."""


def optimizer_params(args) -> dict:
    return {"lr": args.lr, "betas": BETAS, "eps": EPS, "weight_decay": WEIGHT_DECAY}


def row_config(name: str, args) -> dict:
    """The DeepSpeed-style config of a row; zerokit's and DeepSpeed's differ only in the keys each
    library has (stochastic_rounding is zerokit's; DeepSpeed is handed it and says what it thinks)."""
    lib, master16, states16, sr, _ = ROWS[name]
    opt = optimizer_params(args)
    if lib == "deepspeed" and master16:
        opt["fp32_optimizer_states"] = False  # DeepSpeedCPUAdam's moments in the parameters' dtype
    bf16: dict = {"enabled": True}
    if master16:
        bf16["bf16_master_weights_and_grads"] = True
    if states16:
        bf16["bf16_optimizer_states"] = True
    if sr:
        bf16.update(stochastic_rounding=True, stochastic_rounding_seed=args.seed)
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": opt},
        "gradient_clipping": CLIPPING,
        "bf16": bf16,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}},
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }


def batches(args, split: str, n: int):
    """n (x, y) micro-batches of the stdlib text, in a fixed-seed random order (the same in every row)."""
    import torch
    from zerokit.data import ByteDataset, stdlib_text

    data = ByteDataset(stdlib_text(), args.seq, split=split)
    g = torch.Generator().manual_seed(args.seed + (1 if split == "train" else 2))
    need = n * args.micro_batch
    order = torch.cat([torch.randperm(len(data), generator=g) for _ in range(-(-need // len(data)))])[:need]
    out = []
    for i in range(n):
        xs, ys = zip(*(data[int(j)] for j in order[i * args.micro_batch:(i + 1) * args.micro_batch]))
        out.append((torch.stack(xs), torch.stack(ys)))
    return out, len(data)


def build_engine(name: str, args, rec: dict):
    import torch
    from zerokit.models import GPT, GPTConfig

    lib = ROWS[name][0]
    cfg = row_config(name, args)
    rec["config"] = cfg
    torch.manual_seed(args.seed)  # the same initial weights in every row
    model = GPT(GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                          block_size=args.seq, vocab_size=256))
    rec["n_params"] = sum(p.numel() for p in model.parameters())
    try:
        if lib == "zerokit":
            import zerokit

            engine, _, _, _ = zerokit.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        else:
            import logging

            import deepspeed
            from deepspeed.utils import logger as ds_logger

            ds_logger.setLevel(logging.WARNING)
            deepspeed.init_distributed(dist_backend="gloo")
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except Exception as e:  # the library's refusal of this configuration is the row's result
        rec["traceback"] = traceback.format_exc()
        raise Refused(f"{type(e).__name__}: {e}") from e
    opt = getattr(engine, "optimizer", None)
    rec["optimizer"] = type(opt).__name__
    inner = getattr(opt, "optimizer", None)
    if inner is not None:
        rec["inner_optimizer"] = type(inner).__name__
        rec["fp32_optimizer_states"] = getattr(inner, "fp32_optimizer_states", None)
    return engine


def master_dtypes(engine) -> list[str]:
    """DeepSpeed: the dtypes of the partitions its optimizer steps (what bf16 master means there)."""
    groups = getattr(engine.optimizer, "single_partition_of_fp32_groups", None) or []
    return sorted({str(t.dtype) for t in groups})


def run_worker(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    name = args.worker
    rec: dict = {"row": name, "status": "ok"}
    out = Path(args.result)

    def dump():
        rec["peak_rss_mb"] = C.peak_rss_mb()
        out.write_text(json.dumps(rec, indent=1) + "\n")

    try:
        train, n_train = batches(args, "train", args.steps)
        held, _ = batches(args, "val", args.eval_batches)
        rec["train_windows"] = n_train
        t0 = C.now()
        engine = build_engine(name, args, rec)
        rec["setup_s"] = C.now() - t0
        if ROWS[name][0] == "deepspeed":
            rec["master_dtypes"] = master_dtypes(engine)
        torch.set_num_threads(args.threads)  # in case a library changed it
        engine.train()
        losses, step_s = [], []
        t0 = C.now()
        for i, (x, y) in enumerate(train):
            t1 = C.now()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach().float()))
            step_s.append(C.now() - t1)
            if i % 50 == 0 or i == len(train) - 1:
                print(f"step {i}: loss {losses[-1]:.4f} ({C.now() - t0:.1f} s)", flush=True)
        rec["train_s"] = C.now() - t0
        rec["losses"], rec["step_s"] = losses, step_s
        engine.eval()
        with torch.no_grad():
            rec["eval_loss"] = sum(float(engine(x, y).detach().float()) for x, y in held) / len(held)
        dump()
        return 0
    except Refused as e:
        rec.update(status="refused", reason=str(e))
        dump()
        return 0
    except Exception as e:
        rec.update(status="error", reason=f"{type(e).__name__}: {str(e)[:400]}", traceback=traceback.format_exc())
        dump()
        raise


# ===================================================================================== parent
def run_row(name: str, args, port: int) -> dict:
    lib, master16, states16, sr, label = ROWS[name]
    res = {"row": name, "library": lib, "label": label, "bf16_master": master16,
           "bf16_states": states16, "stochastic_rounding": sr}
    with tempfile.TemporaryDirectory(prefix=f"zk-bf16q-{name}-") as tmp:
        result = Path(tmp) / "row.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--result", str(result),
               "--steps", str(args.steps), "--lr", repr(args.lr), "--layers", str(args.layers),
               "--width", str(args.width), "--heads", str(args.heads), "--seq", str(args.seq),
               "--micro-batch", str(args.micro_batch), "--threads", str(args.threads),
               "--seed", str(args.seed), "--eval-batches", str(args.eval_batches),
               "--last-k", str(args.last_k)]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
               "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1", "RANK": "0", "LOCAL_RANK": "0",
               "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        log = C.results_dir("logs") / f"bench_bf16_quality-{name}.log"
        res["loadavg_before"] = list(os.getloadavg())
        t0 = C.now()
        try:
            with open(log, "w") as f:
                rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=C.REPO_ROOT,
                                    timeout=args.row_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        res.update(wall_s=C.now() - t0, returncode=rc, log=str(log), loadavg_after=list(os.getloadavg()))
        rec = json.loads(result.read_text()) if result.exists() else {}
    res["status"] = rec.get("status", "error")
    if res["status"] == "ok" and rc != 0:
        res["status"] = "error"
    if res["status"] != "ok":
        res["reason"] = rec.get("reason") or f"exit {rc}; see {log}"
        if rec.get("traceback"):
            res["traceback_tail"] = rec["traceback"].splitlines()[-8:]
        res["config"] = rec.get("config")
        return res
    losses = rec["losses"]
    res.update({k: rec.get(k) for k in ("config", "n_params", "setup_s", "train_s", "eval_loss", "peak_rss_mb",
                                         "optimizer", "inner_optimizer", "fp32_optimizer_states",
                                         "master_dtypes", "train_windows")})
    res["losses"] = losses
    res["final_loss"] = sum(losses[-args.last_k:]) / args.last_k
    res["step_s"] = rec["step_s"]
    res["s_per_step"] = C.summarize(rec["step_s"])["median"]  # median: robust to others' load bursts
    return res


def add_comparisons(results: list[dict]) -> None:
    """Each row's final and held-out loss vs its own library's fp32 row, in %."""
    ref = {r["library"]: r for r in results if r["status"] == "ok" and not r["bf16_master"]}
    for r in results:
        base = ref.get(r["library"])
        if r["status"] == "ok" and base is not None:
            r["final_vs_fp32_pct"] = 100.0 * (r["final_loss"] / base["final_loss"] - 1.0)
            r["eval_vs_fp32_pct"] = 100.0 * (r["eval_loss"] / base["eval_loss"] - 1.0)


def report(results: list[dict]) -> str:
    headers = ["row", "config", "final loss", "vs fp32", "held-out loss", "vs fp32", "wall s", "train s",
               "median s/step", "note"]
    rows = []
    for r in results:
        if r["status"] != "ok":
            why = " ".join(str(r.get("reason", "")).split())  # the library's text, on one line
            rows.append([r["row"], r["label"], "", "", "", "", C.fmt_num(r.get("wall_s"), ".0f"), "", "",
                         f"{r['status']}: {why}"[:150]])
            continue
        note = []
        if r.get("master_dtypes"):
            note.append(f"stepped partitions {','.join(d.replace('torch.', '') for d in r['master_dtypes'])}")
        if r.get("inner_optimizer"):
            note.append(r["inner_optimizer"] + (f" fp32_optimizer_states={r['fp32_optimizer_states']}"
                                                if r.get("fp32_optimizer_states") is not None else ""))
        rows.append([r["row"], r["label"], C.fmt_num(r["final_loss"], ".4f"),
                     C.fmt_num(r.get("final_vs_fp32_pct"), "+.2f", "%"), C.fmt_num(r["eval_loss"], ".4f"),
                     C.fmt_num(r.get("eval_vs_fp32_pct"), "+.2f", "%"), C.fmt_num(r["wall_s"], ".0f"),
                     C.fmt_num(r["train_s"], ".0f"),
                     C.fmt_num(r["s_per_step"], ".3f"), "; ".join(note)])
    return C.format_table(headers, rows)


def smooth(xs: list[float], w: int) -> list[float]:
    """Trailing moving mean over w steps (fewer at the start)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def plot(results: list[dict], args, path: Path) -> str:
    """All loss curves in one PNG (top), and each bf16 row's smoothed loss minus its library's fp32
    row's (bottom: the curves overlap at the top's scale). matplotlib is optional (zerokit's `plot`
    extra): without it, the reason is returned and no PNG written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no PNG: matplotlib is not installed ({e}); `pip install matplotlib` for the plot"
    ok = [r for r in results if r["status"] == "ok"]
    ref = {r["library"]: smooth(r["losses"], args.smooth) for r in ok if not r["bf16_master"]}
    fig, (ax, dx) = plt.subplots(2, 1, figsize=(9, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    style = {"zerokit": "-", "deepspeed": "--"}
    for r in ok:
        curve = smooth(r["losses"], args.smooth)
        steps = range(1, len(curve) + 1)
        line, = ax.plot(steps, curve, style[r["library"]], lw=1.3, label=f"{r['row']}: {r['final_loss']:.3f}")
        base = ref.get(r["library"])
        if base is not None:
            dx.plot(steps, [a - b for a, b in zip(curve, base)], style[r["library"]], lw=1.3,
                    color=line.get_color(), label=r["row"])
    ax.set_ylabel(f"training loss (moving mean over {args.smooth} steps)")
    ax.set_title(f"bf16 master + states vs fp32: GPT {args.layers}x{args.width} seq {args.seq} "
                 f"mb {args.micro_batch}, AdamW lr {args.lr:g}, ZeRO-2 offload cpu", fontsize=10)
    ax.legend(title=f"row: final loss (last {args.last_k} steps)", fontsize=8)
    dx.axhline(0.0, color="grey", lw=0.8)
    dx.set_ylabel("minus its library's fp32 row")
    dx.set_xlabel("step")
    for a in (ax, dx):
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def replot(json_path: str) -> int:
    """--replot: the PNG of a result JSON again (beside it, and as -latest.png)."""
    payload = json.loads(Path(json_path).read_text())
    setup = payload["setup"]
    model = setup["model"]
    args = argparse.Namespace(layers=model["n_layer"], width=model["n_embd"], seq=model["block_size"],
                              micro_batch=setup["micro_batch"], lr=setup["optimizer"]["lr"],
                              smooth=setup["smooth"], last_k=setup.get("last_k") or int(setup["final_loss"].split()[4]))
    png = Path(json_path).with_suffix(".png")
    print(plot(payload["rows"], args, png))
    if png.exists():
        (C.results_dir() / "bench_bf16_quality-latest.png").write_bytes(png.read_bytes())
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    if args.replot:
        return replot(args.replot)
    names = [n for n in args.rows.split(",") if n]
    for n in names:
        if n not in ROWS:
            raise SystemExit(f"--rows: unknown {n!r}; choose from {', '.join(ROWS)}")
    machine = C.machine_info()
    print(f"bench_bf16_quality: rows {', '.join(names)}; GPT {args.layers}x{args.width} (heads {args.heads}) "
          f"seq {args.seq} micro-batch {args.micro_batch}, {args.steps} steps, AdamW lr {args.lr:g} constant, "
          f"ZeRO-2 offload_optimizer cpu, bf16 compute, 1 process x {args.threads} threads; final loss = "
          f"mean of the last {args.last_k} steps", flush=True)
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} cpus, torch {machine['torch']}, "
          f"deepspeed {machine.get('deepspeed')}", flush=True)
    results = []
    for i, name in enumerate(names):
        r = run_row(name, args, 29600 + i)
        results.append(r)
        msg = (f"final loss {r['final_loss']:.4f}, held-out {r['eval_loss']:.4f}, {r['train_s']:.0f} s"
               if r["status"] == "ok" else f"{r['status']}: {' '.join(str(r.get('reason', '')).split())}")
        print(f"  {name:13s} {msg}", flush=True)
    add_comparisons(results)
    table = report(results)
    print()
    print(table)
    verdict = {}
    by = {r["row"]: r for r in results if r["status"] == "ok"}
    for row in ("zk-bf16-sr", "zk-bf16-rtn", "ds-bf16-rtn"):
        if row in by and "final_vs_fp32_pct" in by[row]:
            verdict[row] = by[row]["final_vs_fp32_pct"]
    if "zk-bf16-sr" in verdict:
        ok = abs(verdict["zk-bf16-sr"]) <= 1.0
        print(f"\nissue #27's bar: zk-bf16-sr's final loss within 1% of zk-fp32's: "
              f"{'met' if ok else 'NOT met'} ({verdict['zk-bf16-sr']:+.2f}%)")
    for row in ("zk-bf16-rtn", "ds-bf16-rtn"):
        if row in verdict:
            print(f"{row} (round-to-nearest) vs its fp32 row: {verdict[row]:+.2f}%")
    stamp = C.timestamp()
    png = C.results_dir() / f"bench_bf16_quality-{stamp}.png"
    note = plot(results, args, png)
    if png.exists():
        (C.results_dir() / "bench_bf16_quality-latest.png").write_bytes(png.read_bytes())
    print(note)
    machine["loadavg_at_end"] = list(os.getloadavg())
    setup = {"model": {"n_layer": args.layers, "n_embd": args.width, "n_head": args.heads,
                       "block_size": args.seq, "vocab_size": 256},
             "micro_batch": args.micro_batch, "steps": args.steps, "threads": args.threads, "seed": args.seed,
             "optimizer": {"type": "AdamW", **optimizer_params(args)}, "gradient_clipping": CLIPPING,
             "lr_schedule": "constant", "zero_stage": 2, "offload_optimizer": "cpu", "world_size": 1,
             "data": "zerokit.data.stdlib_text / ByteDataset (train 95%, held-out 5%), fixed-seed order",
             "final_loss": f"mean of the last {args.last_k} steps' training losses",
             "last_k": args.last_k, "eval_batches": args.eval_batches, "smooth": args.smooth}
    payload = {"benchmark": "bench_bf16_quality", "argv": sys.argv[1:], "setup": setup, "machine": machine,
               "rows": results, "sr_vs_fp32_pct": verdict.get("zk-bf16-sr"), "table": table, "plot": note}
    # the JSON under the PNG's timestamp (write_json would take its own), and -latest.json beside it
    path = C.write_json("bench_bf16_quality", payload, args.out or png.with_suffix(".json"))
    if args.out is None:
        (C.results_dir() / "bench_bf16_quality-latest.json").write_text(path.read_text())
    print(f"wrote {path}")
    return 0 if all(r["status"] != "error" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
