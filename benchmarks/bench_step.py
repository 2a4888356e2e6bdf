#!/usr/bin/env python
"""Step time and peak memory of one data-parallel training step: zerokit vs its peers.

    flock /tmp/zk-heavy.lock .venv/bin/python benchmarks/bench_step.py            # every default row
    python benchmarks/bench_step.py --only ddp,ds-z2,zk-z2 --steps 20
    python benchmarks/bench_step.py --zero3                                       # + the ZeRO-3 rows
    python benchmarks/bench_step.py --compare HEAD~1 --rounds 3   # zerokit rows: this tree vs HEAD~1
    python benchmarks/bench_step.py --zero3 --rounds 2   # every row twice, alternated; medians
    python benchmarks/bench_step.py --only ddp,zk-z2,zk-z3 --profile   # + where each phase's time goes

Each row is launched as its own `torchrun --standalone --nproc-per-node N` job (N=2 gloo ranks on
this CPU, one intra-op thread per rank) that trains the demo GPT (6 layers, width 512, seq 256,
micro-batch 4, AdamW, fp32, random byte tokens from a fixed seed): a few warm-up steps, then the
timed steps. A step is forward + backward + optimizer step (+ zero_grad); its time is the slowest
rank's, and the row reports the median over the timed steps, and the peak RSS of the biggest rank
(ru_maxrss, so it includes the libraries' own import footprint; the JSON also has the peak minus
the RSS just before the model was built) and the minor page faults per step (memory touched
for the first time: allocation churn; the busier rank's median). Every measured number goes to
benchmarks/results/bench_step-<timestamp>.json (and bench_step-latest.json) with the machine
description; each row's raw torchrun output goes to benchmarks/results/logs/.

Rows: ddp (torch DDP), fsdp2 (fully_shard per block then root, reshard_after_forward=False),
ds-z1 / ds-z2 / ds-z3 (DeepSpeed ZeRO-k, CPU accelerator, gloo, torch AdamW via `torch_adam`),
zk-z0 / zk-z1 / zk-z2 / zk-z3 (zerokit.initialize, stage k). Group names for --only: peers,
deepspeed, zerokit, all. The rows are run one after another (never overlapping), as the ranks of
one row already use the cores.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import _profile as P  # noqa: E402

PROF = P.Profiler()  # a worker's profile (bench_step --profile); phases set by the zerokit row

# name -> (family, zero stage or None, label)
ROWS: dict[str, tuple[str, int | None, str]] = {
    "ddp": ("ddp", None, "torch DDP"),
    "fsdp2": ("fsdp2", None, "torch FSDP2 fully_shard"),
    "fsdp2-rs": ("fsdp2", 3, "FSDP2 reshard_after_forward"),
    "ds-z1": ("deepspeed", 1, "DeepSpeed ZeRO-1"),
    "ds-z2": ("deepspeed", 2, "DeepSpeed ZeRO-2"),
    "ds-z3": ("deepspeed", 3, "DeepSpeed ZeRO-3"),
    "zk-z0": ("zerokit", 0, "zerokit stage 0"),
    "zk-z1": ("zerokit", 1, "zerokit stage 1"),
    "zk-z2": ("zerokit", 2, "zerokit stage 2"),
    "zk-z3": ("zerokit", 3, "zerokit stage 3"),
}
DEFAULT_ROWS = ["ddp", "fsdp2", "ds-z1", "ds-z2", "zk-z0", "zk-z1", "zk-z2"]
ZERO3_ROWS = ["fsdp2-rs", "ds-z3", "zk-z3"]
GROUPS = {
    "peers": ["ddp", "fsdp2", "ds-z1", "ds-z2"],
    "deepspeed": ["ds-z1", "ds-z2", "ds-z3"],
    "zerokit": ["zk-z0", "zk-z1", "zk-z2", "zk-z3"],
    "all": list(ROWS),
}

# Optimizer hyper-parameters, identical for every row (torch.optim.AdamW's defaults, lr 1e-4).
ADAMW = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}

# Environment of every rank: one intra-op thread, DeepSpeed on its CPU accelerator.
WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "DS_ACCELERATOR": "cpu",
    "PYTHONUNBUFFERED": "1",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None,
                   help=f"comma-separated rows or groups to run (rows: {', '.join(ROWS)}; "
                        f"groups: {', '.join(GROUPS)}); default: {', '.join(DEFAULT_ROWS)}")
    p.add_argument("--zero3", action="store_true", help="also run the ZeRO-3 rows (ds-z3, zk-z3)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps (default 3)")
    p.add_argument("--layers", type=int, default=6, help="GPT n_layer (default 6)")
    p.add_argument("--width", type=int, default=512, help="GPT n_embd (default 512)")
    p.add_argument("--heads", type=int, default=8, help="GPT n_head (default 8)")
    p.add_argument("--seq", type=int, default=256, help="sequence length = block_size (default 256)")
    p.add_argument("--micro-batch", type=int, default=4, help="micro-batch per rank (default 4)")
    p.add_argument("--nproc", type=int, default=2, help="ranks per row (default 2)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the model init and the data")
    p.add_argument("--row-timeout", type=float, default=1200.0, help="seconds before a row is killed")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_step-<time>.json)")
    p.add_argument("--compare", default=None, metavar="REV",
                   help="run the zerokit rows against this tree and git revision REV, alternating "
                        "(benchmarks/_compare.py); default rows: zk-z1, zk-z2, zk-z3")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds: every row once per round, rows alternated, the median over rounds "
                        "reported (default 1; 2 with --compare)")
    p.add_argument("--without", default="", metavar="GUARANTEES",
                   help="zerokit rows without a guarantee, to price it: 'agreement' (no rank-"
                        "agreement headers) and/or 'publish' (async_weight_publish: step() returns "
                        "before the new weights landed); comma-separated")
    p.add_argument("--profile", action="store_true",
                   help="also a per-phase profile of each row beside the same model trained "
                        "locally, zerokit's rows split by function, and the overlap (_profile.py)")
    # internal: a rank of one row, started by torchrun from the parent
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(filter(None, args.without.split(","))) - {"agreement", "publish"}
    if unknown:
        p.error(f"--without: unknown {sorted(unknown)}; allowed: agreement, publish")
    if args.rounds is None:
        args.rounds = 2 if args.compare else 1
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def resolve_rows(args) -> list[str]:
    if args.only is None:
        names = list(DEFAULT_ROWS) + (ZERO3_ROWS if args.zero3 else [])
    else:
        names = []
        for tok in (t.strip() for t in args.only.split(",")):
            if not tok:
                continue
            if tok in GROUPS:
                names += GROUPS[tok]
            elif tok in ROWS:
                names.append(tok)
            else:
                raise SystemExit(f"unknown row {tok!r}; rows: {', '.join(ROWS)}; groups: {', '.join(GROUPS)}")
        if args.zero3:
            names += ZERO3_ROWS
    seen: list[str] = []
    for n in names:
        if n not in seen:
            seen.append(n)
    return seen


# ===================================================================================== worker
class NotAvailable(Exception):
    """The library behind a row is not installed / lacks the API: the row is reported, not failed."""


def _model_config(args):
    from zerokit.models import GPTConfig

    return GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                     block_size=args.seq, vocab_size=256)


def _build_model(args):
    import torch
    from zerokit.models import GPT

    torch.manual_seed(args.seed)  # same initial weights on every rank and in every row
    return GPT(_model_config(args))


def _init_gloo():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")


def setup_ddp(args, rec):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init_gloo()
    rec["rss_baseline_mb"] = C.current_rss_mb()
    model = DDP(_build_model(args))
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)

    def step(x, y):
        loss = model(x, y)
        t1 = C.now()
        loss.backward()
        t2 = C.now()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss, t1, t2

    return model, step


def setup_fsdp2(args, rec, reshard: bool = False):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init_gloo()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rec["rss_baseline_mb"] = C.current_rss_mb()
    model = _build_model(args)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)

    def step(x, y):
        loss = model(x, y)
        t1 = C.now()
        loss.backward()
        t2 = C.now()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss, t1, t2

    return model, step


def _ds_config(args, stage):
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        # torch_adam: torch.optim.AdamW, the same optimizer code as the DDP/FSDP2 rows (DeepSpeed's
        # default on this accelerator would JIT-build its CPU FusedAdam op).
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def setup_deepspeed(args, rec, stage):
    try:
        import deepspeed
    except ImportError as e:
        raise NotAvailable(f"deepspeed not installed ({e}); run `make bench-deps`") from e
    import logging

    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    rec["rss_baseline_mb"] = C.current_rss_mb()
    rec["deepspeed_config"] = _ds_config(args, stage)
    model = _build_model(args)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=_ds_config(args, stage))
    rec["deepspeed_optimizer"] = type(engine.optimizer).__name__
    rec["deepspeed_basic_optimizer"] = type(getattr(engine, "basic_optimizer", None)).__name__

    def step(x, y):
        loss = engine(x, y)
        t1 = C.now()
        engine.backward(loss)
        t2 = C.now()
        engine.step()
        return loss, t1, t2

    return engine, step


def zerokit_config(args, stage):
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": dict(ADAMW)},
        # Stage 3 as FSDP2 with reshard_after_forward: release each block after use, prefetch one
        # block (3.2M elements) ahead; DeepSpeed's defaults (reuse distance and live cap 1e9)
        # would keep the whole model gathered through the step at this size.
        "zero_optimization": {"stage": stage, **({"stage3_prefetch_bucket_size": 4_000_000,
                                                  "stage3_max_reuse_distance": 0}
                                                 if stage == 3 else {})},
    }


def setup_zerokit(args, rec, stage):
    try:
        import zerokit
    except ImportError as e:
        raise NotAvailable(f"import zerokit failed ({e})") from e
    if not hasattr(zerokit, "initialize"):
        raise NotAvailable("zerokit has no initialize() yet")
    config = zerokit_config(args, stage)
    if "publish" in args.without.split(","):
        config["zero_optimization"]["async_weight_publish"] = True
    rec["zerokit_config"] = config
    rec["zerokit_file"] = zerokit.__file__  # which tree the row ran (--compare checks it)
    rec["rss_baseline_mb"] = C.current_rss_mb()
    model = _build_model(args)
    # zerokit initializes torch.distributed itself from torchrun's env vars (as deepspeed does).
    engine, _, _, _ = zerokit.initialize(model=model, model_parameters=model.parameters(),
                                         config=config)
    _init_gloo()  # no-op if zerokit did it; the harness needs it for its barriers
    if "agreement" in args.without.split(","):
        engine.comm.agreement = None  # priced by --without (never a user setting)

    def step(x, y):
        PROF.phase = "forward"
        loss = engine(x, y)
        t1 = C.now()
        PROF.phase = "backward"
        engine.backward(loss)
        t2 = C.now()
        PROF.phase = "step"
        engine.step()
        PROF.phase = "other"
        return loss, t1, t2

    if args.profile:
        P.instrument_zerokit(PROF)
    return engine, step


def run_worker(args) -> int:
    import torch

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    family, stage, label = ROWS[args.worker]
    rec: dict = {"row": args.worker, "label": label, "rank": rank, "world_size": world, "status": "ok"}
    out = Path(args.result_dir) / f"rank{rank}.json"

    def dump():
        rec["peak_rss_mb"] = C.peak_rss_mb()
        out.write_text(json.dumps(rec, indent=1) + "\n")

    try:
        if args.profile:  # the local reference first, in the same fresh process for every row
            _init_gloo()  # zerokit and DeepSpeed reuse it
            rec["local"] = P.local_compute(lambda: _build_model(args), ADAMW, args, rank)
        t0 = C.now()
        try:
            if family == "ddp":
                model, step = setup_ddp(args, rec)
            elif family == "fsdp2":
                model, step = setup_fsdp2(args, rec, reshard=stage == 3)
            elif family == "deepspeed":
                model, step = setup_deepspeed(args, rec, stage)
            elif family == "zerokit":
                model, step = setup_zerokit(args, rec, stage)
            else:  # pragma: no cover
                raise ValueError(family)
        except NotImplementedError as e:  # e.g. a zerokit stage not written yet
            raise NotAvailable(f"NotImplementedError: {e}") from e
        rec["setup_s"] = C.now() - t0
        rec["threads_after_setup"] = torch.get_num_threads()
        torch.set_num_threads(1)  # in case a library changed it
        rec["rss_after_setup_mb"] = C.current_rss_mb()
        rec["n_params"] = _count_params(args)

        import torch.distributed as dist

        # Fixed-seed random bytes, different per rank (as a data loader's shards would be), same
        # in every row, all made before the clock starts.
        g = torch.Generator().manual_seed(args.seed + 1 + rank)
        n = args.warmup + args.steps
        toks = [torch.randint(0, 256, (args.micro_batch, args.seq + 1), generator=g) for _ in range(n)]
        model.train()
        losses, fwd, bwd, opt, total, faults = [], [], [], [], [], []
        for i in range(n):
            x, y = toks[i][:, :-1].contiguous(), toks[i][:, 1:].contiguous()
            dist.barrier()
            PROF.start_step(record=i == n - 1)
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = C.now()
            loss, t1, t2 = step(x, y)
            t3 = C.now()
            f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            if i >= args.warmup:
                PROF.end_step()
            losses.append(float(loss.detach()))
            if i >= args.warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
                opt.append(t3 - t2)
                total.append(t3 - t0)
                faults.append(f1 - f0)
        rec.update(step_s=total, forward_s=fwd, backward_s=bwd, optimizer_s=opt, losses=losses,
                   minor_faults=faults)
        rec["rss_end_mb"] = C.current_rss_mb()
        if args.profile:
            import torch

            rec["profile"] = {"labels": PROF.medians(), "local": rec.pop("local"),
                              "alone": P.replay_exchanges(PROF.exchanges)}
        dist.barrier()
        dump()
        dist.destroy_process_group()
        return 0
    except NotAvailable as e:
        rec.update(status="not available", reason=str(e))
        dump()
        return 0
    except Exception as e:  # report, then fail the row
        rec.update(status="error", reason=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        dump()
        raise


def _count_params(args) -> int:
    """Parameters of the unwrapped model (built on the meta device: wrappers shard or flatten theirs)."""
    import torch
    from zerokit.models import GPT

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(_model_config(args)).parameters())


# ===================================================================================== parent
def _forwarded_args(args) -> list[str]:
    return (["--profile"] if args.profile else []) + ["--without", args.without, "--steps", str(args.steps), "--warmup", str(args.warmup), "--layers", str(args.layers),
            "--width", str(args.width), "--heads", str(args.heads), "--seq", str(args.seq),
            "--micro-batch", str(args.micro_batch), "--seed", str(args.seed)]


def run_row(name: str, args, log_dir: Path, extra_env: dict[str, str] | None = None) -> dict:
    family, stage, label = ROWS[name]
    res: dict = {"row": name, "label": label, "family": family, "stage": stage}
    with tempfile.TemporaryDirectory(prefix=f"zk-bench-{name}-") as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
               f"--nproc-per-node={args.nproc}", str(Path(__file__).resolve()),
               "--worker", name, "--result-dir", tmp, *_forwarded_args(args)]
        env = {**os.environ, **WORKER_ENV, **(extra_env or {})}
        log_path = log_dir / f"bench_step-{name}.log"
        res["loadavg_before"] = list(os.getloadavg())
        t0 = C.now()
        try:
            with open(log_path, "w") as log:
                proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=args.row_timeout, cwd=C.REPO_ROOT)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        res["wall_s"] = C.now() - t0
        res["loadavg_after"] = list(os.getloadavg())
        res["returncode"] = rc
        res["log"] = str(log_path.relative_to(C.REPO_ROOT)) if log_path.is_relative_to(C.REPO_ROOT) else str(log_path)
        ranks = []
        for r in range(args.nproc):
            f = Path(tmp) / f"rank{r}.json"
            if f.exists():
                ranks.append(json.loads(f.read_text()))
    res["ranks"] = ranks
    statuses = {r["status"] for r in ranks}
    if rc == 0 and len(ranks) == args.nproc and statuses == {"ok"}:
        res["status"] = "ok"
    elif "not available" in statuses and "error" not in statuses:
        res["status"] = "not available"
        res["reason"] = next(r["reason"] for r in ranks if r["status"] == "not available")
        return res
    else:
        res["status"] = "error"
        errs = [r for r in ranks if r["status"] == "error"]
        res["reason"] = errs[0]["reason"] if errs else f"torchrun exit {rc}; see {res['log']}"
        if errs:  # the worker's own traceback says more than torchrun's summary
            res["log_tail"] = errs[0]["traceback"].splitlines()[-12:]
        elif log_path.exists():
            res["log_tail"] = log_path.read_text(errors="replace").splitlines()[-15:]
        return res

    step = C.elementwise_max([r["step_s"] for r in ranks])
    res["step_s_per_step"] = step
    res["step_s"] = C.summarize(step)
    for part in ("forward_s", "backward_s", "optimizer_s"):
        res[part] = C.summarize(C.elementwise_max([r[part] for r in ranks]))
    # pages touched for the first time per step (memory freshly mapped: allocation churn), the
    # busier rank's
    res["minor_faults"] = C.summarize(C.elementwise_max([r["minor_faults"] for r in ranks]))
    res["peak_rss_mb_per_rank"] = [r["peak_rss_mb"] for r in ranks]
    res["peak_rss_mb"] = max(res["peak_rss_mb_per_rank"])
    res["peak_minus_baseline_mb"] = max(r["peak_rss_mb"] - r["rss_baseline_mb"] for r in ranks)
    res["setup_s"] = max(r["setup_s"] for r in ranks)
    res["losses_rank0"] = ranks[0]["losses"]
    res["final_loss_rank0"] = ranks[0]["losses"][-1]
    res["n_params"] = ranks[0]["n_params"]
    if "profile" in ranks[0]:
        res["profile"] = ranks[0]["profile"]
    return res


def add_loss_check(results: dict[str, dict]) -> None:
    """Every row trains the same model on the same data with the same optimizer, so its losses should
    match DDP's up to float reordering: record the largest difference over all steps (rank 0)."""
    ddp = results.get("ddp", {})
    if ddp.get("status") != "ok":
        return
    for r in results.values():
        if r.get("status") == "ok":
            a, b = r["losses_rank0"], ddp["losses_rank0"]
            r["max_abs_loss_diff_vs_ddp"] = max(abs(x - y) for x, y in zip(a, b))


def _peer_of(name: str) -> str | None:
    """The DeepSpeed row a zerokit row is compared with (stage k vs ZeRO-k)."""
    family, stage, _ = ROWS[name]
    if family == "zerokit" and stage and f"ds-z{stage}" in ROWS:
        return f"ds-z{stage}"
    return None


def report(results: dict[str, dict]) -> str:
    ddp = results.get("ddp", {})
    ddp_t = ddp.get("step_s", {}).get("median") if ddp.get("status") == "ok" else None
    ddp_m = ddp.get("peak_rss_mb") if ddp.get("status") == "ok" else None
    headers = ["row", "what", "step s (median)", "min", "max", "vs DDP", "vs DS-ZeRO-k",
               "peak RSS/rank MiB", "RSS vs DDP", "RSS vs DS", "page faults/step", "last loss",
               "|dloss| vs DDP", "note"]
    rows = []
    for name, r in results.items():
        if r["status"] != "ok":
            rows.append([name, r["label"], "", "", "", "", "", "", "", "", "", "", "",
                         f"{r['status']}: {r.get('reason', '')}"[:90]])
            continue
        t, m = r["step_s"]["median"], r["peak_rss_mb"]
        peer = results.get(_peer_of(name) or "", {})
        peer_t = peer.get("step_s", {}).get("median") if peer.get("status") == "ok" else None
        peer_m = peer.get("peak_rss_mb") if peer.get("status") == "ok" else None
        rows.append([
            name, r["label"], C.fmt_num(t), C.fmt_num(r["step_s"]["min"]), C.fmt_num(r["step_s"]["max"]),
            C.fmt_num(C.ratio(t, ddp_t), ".2f", "x"), C.fmt_num(C.ratio(t, peer_t), ".2f", "x"),
            C.fmt_num(m, ".0f"), C.fmt_num(C.ratio(m, ddp_m), ".2f", "x"),
            C.fmt_num(C.ratio(m, peer_m), ".2f", "x"),
            C.fmt_num((r.get("minor_faults") or {}).get("median"), ".0f"),
            C.fmt_num(r["final_loss_rank0"], ".4f"),
            C.fmt_num(r.get("max_abs_loss_diff_vs_ddp"), ".1e"), "",
        ])
    return C.format_table(headers, rows)


def run_rounds(names: list[str], args) -> dict[str, dict]:
    """Every row once per round (--rounds), the order reversed every other round so that no row
    always runs first; one result per row, its times the median of the rounds' (C.merge_rounds)."""
    log_dir = C.results_dir("logs")
    rounds: list[dict[str, dict]] = []
    for k in range(args.rounds):
        results: dict[str, dict] = {}
        for name in (names if k % 2 == 0 else names[::-1]):
            r = run_row(name, args, log_dir)
            results[name] = r
            if r["status"] == "ok":
                print(f"  round {k + 1} {name:6s} {r['step_s']['median']:.3f} s/step  peak RSS "
                      f"{r['peak_rss_mb']:.0f} MiB  (row wall {r['wall_s']:.0f} s)", flush=True)
            else:
                print(f"  round {k + 1} {name:6s} {r['status']}: {r.get('reason', '')}", flush=True)
                for line in r.get("log_tail", []):
                    print(f"      | {line}")
        rounds.append(results)
    return C.merge_rounds(names, rounds)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    if args.compare:
        return main_compare(args)
    names = resolve_rows(args)
    machine = C.machine_info()
    setup = {"model": {"n_layer": args.layers, "n_embd": args.width, "n_head": args.heads,
                       "block_size": args.seq, "vocab_size": 256},
             "seq": args.seq, "micro_batch": args.micro_batch, "nproc": args.nproc, "backend": "gloo",
             "threads_per_rank": 1, "dtype": "fp32", "optimizer": {"type": "AdamW", **ADAMW},
             "warmup_steps": args.warmup, "timed_steps": args.steps, "seed": args.seed,
             "worker_env": WORKER_ENV,
             "step_time": "max over ranks of forward+backward+optimizer step, median over timed steps",
             "peak_rss": "ru_maxrss of each rank (MiB), max over ranks"}
    print(f"bench_step: {len(names)} rows ({', '.join(names)}), {args.nproc} gloo ranks x 1 thread, "
          f"GPT {args.layers}x{args.width} seq {args.seq} mb {args.micro_batch}, "
          f"{args.warmup} warm-up + {args.steps} timed steps", flush=True)
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} cpus, torch {machine['torch']}, "
          f"deepspeed {machine.get('deepspeed')}", flush=True)
    results = run_rounds(names, args)
    add_loss_check(results)
    table = report(results)
    print()
    print(table)
    if args.profile:
        print("\nper-phase profile (ms, medians over the timed steps, rank 0; see benchmarks/_profile.py)")
        print(P.table(results))
    machine["loadavg_at_end"] = list(os.getloadavg())
    path = C.write_json("bench_step", {"benchmark": "bench_step", "argv": sys.argv[1:], "setup": setup,
                                       "machine": machine, "rows": results, "table": table}, args.out)
    print(f"\nwrote {path}")
    return 0 if all(r["status"] != "error" for r in results.values()) else 1


def main_compare(args) -> int:
    from _compare import compare

    names = resolve_rows(args) if args.only else ["zk-z1", "zk-z2", "zk-z3"]
    others = [n for n in names if ROWS[n][0] != "zerokit"]
    if others:
        raise SystemExit(f"--compare runs zerokit rows only (the peers do not change between trees): "
                         f"drop {', '.join(others)}")
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    log_dir = C.results_dir("logs")
    print(f"bench_step --compare {args.compare}: {', '.join(names)} x {args.rounds} rounds, "
          f"{args.nproc} gloo ranks, GPT {args.layers}x{args.width} seq {args.seq}", flush=True)
    table, payload = compare(args.compare, names, args.rounds,
                             lambda name, env: run_row(name, args, log_dir, env))
    print()
    print(table)
    path = C.write_json("bench_step-compare", {"benchmark": "bench_step --compare", "argv": sys.argv[1:],
                                               "machine": C.machine_info(), **payload, "table": table},
                        args.out)
    print(f"\nwrote {path}")
    return 0 if not payload["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
