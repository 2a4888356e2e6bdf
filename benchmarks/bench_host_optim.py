"""Host optimizer step: zerokit's native kernel vs torch and DeepSpeed, against the memory roof.

    python benchmarks/bench_host_optim.py [--sizes 10e6,100e6] [--steps 12] [--threads 2]

(a) fp32 AdamW on one flat buffer: zerokit vs torch.optim.AdamW(fused=True), (foreach=True) and
    DeepSpeedCPUAdam (when deepspeed is importable).
(b) the mixed-precision host step (bf16 gradient in, unscale x clip, fp32 update, bf16 weights
    out) vs the same work composed from torch ops, and vs DeepSpeedCPUAdam plus its casts.
(c) compressed state (issue #27): the same fused step with a bf16 master and fp32 moments, with
    bf16 master and moments (round-to-nearest and stochastic rounding), vs the fp32-state kernel.

    --cases fp32,mixed,bf16_state   picks the groups to run (default: all)

Rows of one size are timed round-robin (one step each per round), so load from other processes
on a shared machine hits them alike. Each row reports the median of --steps timed steps (after
2 warm-ups), Mparams/s, the bytes the
row must move per parameter, and its time over the roof: those bytes at the in-place streaming
bandwidth measured in the same run (a large x.mul_(c), 8 bytes per element). Writes JSON to
benchmarks/results/bench_host_optim-*.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import format_table, machine_info, now, summarize, write_json  # noqa: E402

from zerokit.optim import host, kernel_info  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
GRAD_SCALE = 0.5 / 1024  # clip coefficient / loss scale

# Bytes each row must move per parameter (reads + writes, no write-allocate):
#   fp32 AdamW step          read p g m v (16), write p m v (12)                      = 28
#   fused mixed host step    read g16 (2) p m v (12), write p m v (12), w16 (2)      = 28
#   upcast g16 -> g32        read 2, write 4 = 6;  unscale g32 in place 8;  downcast p -> w16 6
#   bf16 master, fp32 moments   read g16 p16 m v (12), write p16 m v (10), w16 (2)     = 24
#   bf16 master and moments     read g16 p16 m16 v16 (8), write p16 m16 v16 (6), w16 (2) = 16
BYTES = {"fp32": 28, "mixed_fused": 28, "upcast": 6, "unscale": 8, "downcast": 6,
         "bf16_master": 24, "bf16_all": 16}


def timed(fn: Callable[[], None], steps: int, warmup: int = 2) -> dict:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t = now()
        fn()
        times.append(now() - t)
    return summarize(times)


def timed_interleaved(fns: list[Callable[[], None]], steps: int, warmup: int = 2) -> list[dict]:
    """Times several implementations round-robin, one step each per round, starting each round
    at a different one: on a shared machine, load that comes and goes hits all rows alike."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for k in range(steps):
        for j in range(len(fns)):
            i = (j + k) % len(fns)
            t = now()
            fns[i]()
            times[i].append(now() - t)
    return [summarize(t) for t in times]


def stream_bandwidth(steps: int) -> float:
    """In-place streaming bandwidth in bytes/s: x.mul_(c) reads and writes 8 bytes an element."""
    x = torch.ones(256 * 2**20)  # 1 GiB, far past any cache
    s = timed(lambda: x.mul_(1.0000001), steps)
    return 8 * x.numel() / s["median"]


def deepspeed_adam():
    """DeepSpeedCPUAdam's class, or None with the reason when it cannot be used here."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # ImportError, or deepspeed failing on a machine without a GPU
        return None, f"not installed ({type(e).__name__})"
    return DeepSpeedCPUAdam, None


def _zerokit_step(p, grad, *, threads, grad_scale=1.0, out16=None, state_dtype=None,
                  stochastic=False):
    m = torch.zeros_like(p, dtype=state_dtype or p.dtype)
    v, count = torch.zeros_like(m), [0]

    def step():
        count[0] += 1
        host.adam_step(p, grad, m, v, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                       weight_decay=WD, step=count[0], adamw=True, grad_scale=grad_scale,
                       out16=out16, threads=threads, stochastic_rounding=stochastic)

    return step


def _torch_adamw(p, grad, **kw):
    param = torch.nn.Parameter(p.clone())
    param.grad = grad
    return param, torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)


def _deepspeed_adam(ds_cls, p, grad):
    param = torch.nn.Parameter(p.clone())
    param.grad = grad
    return param, ds_cls([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)


def _composed(opt_step, param, g16, g32, out16, unscale: bool):
    """The mixed step from separate passes: upcast, (unscale), fp32 step, downcast."""

    def step():
        g32.copy_(g16)
        if unscale:
            g32.mul_(GRAD_SCALE)
        opt_step()
        out16.copy_(param.detach())

    return step


def bench_size(n: int, steps: int, threads: int, ds_cls, cases: set[str]) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen)
    g16 = g.to(torch.bfloat16)
    out16 = torch.empty(n, dtype=torch.bfloat16)
    rows: list[dict] = []
    fns: list = []

    def row(case, name, nbytes, fn):
        if case not in cases:
            return
        rows.append({"case": case, "impl": name, "n": n, "bytes_per_param": nbytes, "time": None,
                     "note": None if fn is not None else "deepspeed: not installed"})
        fns.append(fn)

    # (a) fp32 AdamW
    row("fp32", "zerokit HostAdam kernel", BYTES["fp32"], _zerokit_step(p.clone(), g, threads=threads))
    row("fp32", "torch AdamW(fused=True)", BYTES["fp32"], _torch_adamw(p, g, fused=True)[1].step)
    row("fp32", "torch AdamW(foreach=True)", BYTES["fp32"], _torch_adamw(p, g, foreach=True)[1].step)
    row("fp32", "DeepSpeedCPUAdam", BYTES["fp32"],
        _deepspeed_adam(ds_cls, p, g)[1].step if ds_cls is not None else None)

    # (b) mixed precision: bf16 grad in, unscale x clip, fp32 update, bf16 weights out
    composed = BYTES["upcast"] + BYTES["unscale"] + BYTES["fp32"] + BYTES["downcast"]
    row("mixed", "zerokit fused host step", BYTES["mixed_fused"],
        _zerokit_step(p.clone(), g16, threads=threads, grad_scale=GRAD_SCALE, out16=out16))
    g32 = torch.empty(n)
    param, opt = _torch_adamw(p, g32, fused=True)
    row("mixed", "torch: upcast, mul_, AdamW(fused), downcast", composed,
        _composed(opt.step, param, g16, g32, out16, unscale=True))
    # The fused kernel can unscale itself (GradScaler's path): it divides by opt.grad_scale.
    param, opt = _torch_adamw(p, g32, fused=True)
    opt.grad_scale = torch.tensor(1.0 / GRAD_SCALE)
    row("mixed", "torch: upcast, AdamW(fused, grad_scale), downcast",
        BYTES["upcast"] + BYTES["fp32"] + BYTES["downcast"],
        _composed(opt.step, param, g16, g32, out16, unscale=False))
    if ds_cls is not None:
        param, ds = _deepspeed_adam(ds_cls, p, g32)
        fn = _composed(ds.step, param, g16, g32, out16, unscale=True)
    else:
        fn = None
    row("mixed", "DeepSpeedCPUAdam + upcast, mul_, downcast", composed, fn)

    # (c) compressed state: the fused step of (b) with bf16 master and/or moments
    bf16 = torch.bfloat16
    row("bf16_state", "zerokit fused, fp32 master+moments", BYTES["mixed_fused"],
        _zerokit_step(p.clone(), g16, threads=threads, grad_scale=GRAD_SCALE, out16=out16))
    row("bf16_state", "zerokit fused, bf16 master, fp32 moments", BYTES["bf16_master"],
        _zerokit_step(p.to(bf16), g16, threads=threads, grad_scale=GRAD_SCALE, out16=out16,
                      state_dtype=torch.float32))
    row("bf16_state", "zerokit fused, bf16 master+moments", BYTES["bf16_all"],
        _zerokit_step(p.to(bf16), g16, threads=threads, grad_scale=GRAD_SCALE, out16=out16))
    row("bf16_state", "zerokit fused, bf16 master+moments, stochastic", BYTES["bf16_all"],
        _zerokit_step(p.to(bf16), g16, threads=threads, grad_scale=GRAD_SCALE, out16=out16,
                      stochastic=True))

    live = [i for i, fn in enumerate(fns) if fn is not None]
    for i, res in zip(live, timed_interleaved([fns[i] for i in live], steps)):
        rows[i]["time"] = res
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10e6,100e6", help="comma-separated parameter counts")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per row (median reported)")
    ap.add_argument("--threads", type=int, default=2, help="threads for every implementation")
    ap.add_argument("--cases", default="fp32,mixed,bf16_state", help="groups of rows to run")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")
    args = ap.parse_args(argv)
    if args.steps < 10:
        ap.error("--steps must be >= 10 (medians of fewer are too noisy on a shared machine)")
    torch.set_num_threads(args.threads)
    sizes = [int(float(s)) for s in args.sizes.split(",")]

    ds_cls, ds_why = deepspeed_adam()
    bw = stream_bandwidth(args.steps)
    info = kernel_info(threads=args.threads)
    print(f"zerokit kernel: {info}")
    print(f"in-place streaming bandwidth (x.mul_, 1 GiB): {bw / 1e9:.1f} GB/s; threads={args.threads}")
    if ds_cls is None:
        print(f"deepspeed: {ds_why}")

    rows = []
    for n in sizes:
        rows += bench_size(n, args.steps, args.threads, ds_cls, set(args.cases.split(",")))

    table, best = [], {}
    for r in rows:
        if r["time"] is None:
            table.append([r["case"], f"{r['n'] / 1e6:g}M", r["impl"], r["note"], "", "", "", ""])
            continue
        ms = r["time"]["median"] * 1e3
        roof_ms = r["bytes_per_param"] * r["n"] / bw * 1e3
        r.update(ms=ms, mparams_per_s=r["n"] / r["time"]["median"] / 1e6, roof_ms=roof_ms)
        key = (r["case"], r["n"])
        if not r["impl"].startswith("zerokit"):
            best[key] = min(best.get(key, float("inf")), ms)
        table.append([r["case"], f"{r['n'] / 1e6:g}M", r["impl"], f"{ms:.2f}",
                      f"{r['mparams_per_s']:.0f}", r["bytes_per_param"], f"{roof_ms:.2f}",
                      f"{ms / roof_ms:.2f}x"])
    print(format_table(["case", "params", "implementation", "ms/step", "Mparam/s", "B/param",
                        "roof ms", "vs roof"], table))
    for r in rows:
        if r["impl"].startswith("zerokit") and "ms" in r:
            other = best.get((r["case"], r["n"]))
            r["speedup_vs_best_other"] = other / r["ms"] if other else None
            if other:
                print(f"{r['case']} {r['n'] / 1e6:g}M: zerokit {r['ms']:.2f} ms, best other "
                      f"{other:.2f} ms -> {other / r['ms']:.2f}x")
    base = {r["n"]: r["ms"] for r in rows
            if r["case"] == "bf16_state" and "ms" in r and "fp32 master+moments" in r["impl"]}
    for r in rows:
        if r["case"] == "bf16_state" and "ms" in r and r["n"] in base:
            r["speedup_vs_fp32_state"] = base[r["n"]] / r["ms"]
            print(f"bf16_state {r['n'] / 1e6:g}M: {r['impl']}: {r['ms']:.2f} ms, "
                  f"{r['speedup_vs_fp32_state']:.2f}x the fp32-state kernel")
    path = write_json("bench_host_optim", {
        "machine": machine_info(), "kernel": info, "threads": args.threads, "steps": args.steps,
        "stream_bandwidth_bytes_per_s": bw, "deepspeed": ds_why or "installed", "rows": rows},
        args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
