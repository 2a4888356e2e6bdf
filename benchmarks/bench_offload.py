#!/usr/bin/env python
"""ZeRO-Offload step time and memory: zerokit stage 2/3 with and without offload_optimizer (and
with the delayed parameter update, and Twin-Flow), vs DeepSpeed ZeRO-2/3 with offload_optimizer cpu.

    flock /tmp/zk-heavy.lock .venv/bin/python benchmarks/bench_offload.py
    python benchmarks/bench_offload.py --only zk-z2-off,ds-z2-off --steps 5

Same setup as bench_step.py (whose worker, timing loop and row runner this reuses): the demo GPT
(6 x 512, seq 256, micro-batch 4, AdamW, fp32), 2 gloo ranks x 1 thread on this CPU, each row its
own torchrun job; step time = slowest rank, median over the timed steps; peak RSS per rank. On a
CPU-only machine the "device" is CPU memory too, so offload here measures the cost of the extra
host copies and of the host kernel vs torch's AdamW, not PCIe traffic; and the delayed update's
worker thread competes with forward/backward for the same cores (each rank has one).
DeepSpeed's offload rows use its DeepSpeedCPUAdam (what offload_optimizer selects).
Writes benchmarks/results/bench_offload-<timestamp>.json.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import bench_step as S  # noqa: E402

# name -> (family, stage, label); offload variants by name suffix (see _offload_of)
ROWS = {
    "zk-z2": ("zerokit", 2, "zerokit stage 2, no offload"),
    "zk-z2-off": ("zerokit", 2, "zerokit stage 2 + offload_optimizer cpu"),
    "zk-z2-dpu": ("zerokit", 2, "zerokit stage 2 + offload + delayed update"),
    "zk-z2-tf50": ("zerokit", 2, "zerokit stage 2 + Twin-Flow ratio 0.5"),
    "ds-z2-off": ("deepspeed", 2, "DeepSpeed ZeRO-2 + offload_optimizer cpu"),
    "zk-z3": ("zerokit", 3, "zerokit stage 3, no offload"),
    "zk-z3-off": ("zerokit", 3, "zerokit stage 3 + offload_optimizer cpu"),
    "zk-z3-dpu": ("zerokit", 3, "zerokit stage 3 + offload + delayed update"),
    "ds-z3-off": ("deepspeed", 3, "DeepSpeed ZeRO-3 + offload_optimizer cpu"),
}
DEFAULT_ROWS = list(ROWS)


def _offload_of(name: str) -> dict | None:
    if name.endswith("-off"):
        return {"device": "cpu"}
    if name.endswith("-dpu"):
        return {"device": "cpu", "delayed_update": {"enabled": True, "warmup_steps": 1}}
    if name.endswith("-tf50"):
        return {"device": "cpu", "ratio": 0.5}
    return None


def zerokit_config(args, stage):
    cfg = _base_zerokit_config(args, stage)
    off = _offload_of(args.worker)
    if off is not None:
        cfg["zero_optimization"]["offload_optimizer"] = off
    return cfg


def ds_config(args, stage):
    cfg = _base_ds_config(args, stage)
    cfg["optimizer"]["params"].pop("torch_adam", None)  # offload runs DeepSpeedCPUAdam
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


_base_zerokit_config, _base_ds_config = S.zerokit_config, S._ds_config
# bench_step's worker and row runner read these module globals: point them at this benchmark.
S.ROWS, S.zerokit_config, S._ds_config, S.__file__ = ROWS, zerokit_config, ds_config, __file__


def _peer(name: str) -> str | None:
    family, stage, _ = ROWS[name]
    return f"ds-z{stage}-off" if family == "zerokit" and name.endswith(("-off", "-dpu")) else None


def report(results: dict) -> str:
    headers = ["row", "what", "step s", "fwd s", "bwd s", "opt s", "vs DS offload", "vs no offload",
               "peak RSS/rank MiB", "last loss", "note"]
    rows = []
    for name, r in results.items():
        if r["status"] != "ok":
            rows.append([name, r["label"], "", "", "", "", "", "", "", "",
                         f"{r['status']}: {r.get('reason', '')}"[:80]])
            continue
        t = r["step_s"]["median"]
        peer = results.get(_peer(name) or "", {})
        base = results.get(f"zk-z{ROWS[name][1]}", {}) if name.startswith("zk-") else {}
        med = lambda x: x.get("step_s", {}).get("median") if x.get("status") == "ok" else None  # noqa: E731
        note = ""
        off = results.get(name.replace("-dpu", "-off"), {})
        if name.endswith("-dpu") and med(off) and med(base):
            host = med(off) - med(base)  # what offload adds to a step
            if host > 0:
                note = f"hides {100 * (med(off) - t) / host:.0f}% of offload's added time"
        rows.append([name, r["label"], C.fmt_num(t), C.fmt_num(r["forward_s"].get("median")),
                     C.fmt_num(r["backward_s"].get("median")), C.fmt_num(r["optimizer_s"].get("median")),
                     C.fmt_num(C.ratio(t, med(peer)), ".2f", "x"),
                     C.fmt_num(C.ratio(t, med(base)), ".2f", "x") if name != f"zk-z{ROWS[name][1]}" else "",
                     C.fmt_num(r["peak_rss_mb"], ".0f"), C.fmt_num(r["final_loss_rank0"], ".4f"), note])
    return C.format_table(headers, rows)


def main(argv=None) -> int:
    args = S.parse_args(argv)
    if args.worker:
        return S.run_worker(args)
    names = [n.strip() for n in args.only.split(",")] if args.only else DEFAULT_ROWS
    for n in names:
        if n not in ROWS:
            raise SystemExit(f"unknown row {n!r}; rows: {', '.join(ROWS)}")
    machine = C.machine_info()
    print(f"bench_offload: {len(names)} rows, {args.nproc} gloo ranks x 1 thread, GPT {args.layers}x"
          f"{args.width} seq {args.seq} mb {args.micro_batch}, {args.warmup} warm-up + {args.steps} "
          f"timed steps; {machine['cpu_model']}, {machine['cpu_count']} cpus", flush=True)
    log_dir = C.RESULTS_DIR / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in names:
        r = S.run_row(name, args, log_dir)
        results[name] = r
        print(f"  {name:10s} " + (f"{r['step_s']['median']:.3f} s/step  peak RSS {r['peak_rss_mb']:.0f} MiB"
                                  if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"),
              flush=True)
        for line in r.get("log_tail", []) if r["status"] != "ok" else []:
            print(f"      | {line}")
    table = report(results)
    print("\n" + table)
    machine["loadavg_at_end"] = list(os.getloadavg())
    path = C.write_json("bench_offload", {"benchmark": "bench_offload", "argv": sys.argv[1:],
                                          "setup": {"model": f"GPT {args.layers}x{args.width}",
                                                    "seq": args.seq, "micro_batch": args.micro_batch,
                                                    "nproc": args.nproc, "adamw": S.ADAMW},
                                          "machine": machine, "rows": results, "table": table}, args.out)
    print(f"\nwrote {path}")
    return 0 if all(r["status"] != "error" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
