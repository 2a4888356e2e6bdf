#!/usr/bin/env python
"""ZeRO-Offload step time and memory: zerokit stage 2/3 with and without offload_optimizer (and
with the delayed parameter update, and Twin-Flow), vs DeepSpeed ZeRO-2/3 with offload_optimizer cpu.

    flock /tmp/zk-heavy.lock .venv/bin/python benchmarks/bench_offload.py
    python benchmarks/bench_offload.py --only zk-z2-off,ds-z2-off --steps 5
    python benchmarks/bench_offload.py --rounds 2   # every row twice, alternated; medians (bench_step's)

Same setup as bench_step.py (whose worker, timing loop and row runner this reuses): the demo GPT
(6 x 512, seq 256, micro-batch 4, AdamW, fp32), 2 gloo ranks x 1 thread on this CPU, each row its
own torchrun job; step time = slowest rank, median over the timed steps; peak RSS per rank. On a
CPU-only machine the "device" is CPU memory too, so offload here measures the cost of the extra
host copies and of the host kernel vs torch's AdamW, not PCIe traffic; and the delayed update's
worker thread competes with forward/backward for the same cores (each rank has one).
DeepSpeed's offload rows use its DeepSpeedCPUAdam (what offload_optimizer selects).
Writes benchmarks/results/bench_offload-<timestamp>.json.

    flock /tmp/zk-heavy.lock .venv/bin/python benchmarks/bench_offload.py --hiding

measures how much of the host update the delayed parameter update hides, in a setting that gives
"device" and host one core each (the 2-rank rows cannot: each rank's compute and its host thread
share a core): one process (world 1), forward/backward/device work on 1 thread pinned to core 0
standing in for the device, the host optimizer's worker thread pinned to core 1, 1 kernel thread.
hidden = (t_no_delay - t_delay) / t_host_update, with t_host_update the host kernel's own time per
step (timed inside the worker). Both configurations run interleaved in rounds, medians reported.
It shows that the update leaves the critical path when it has a core of its own; it does not
show GPU timings: no PCIe copies, and the two cores share caches and memory bandwidth.
Writes benchmarks/results/bench_offload_hiding-<timestamp>.json.
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
    "zk-z3-offp": ("zerokit", 3, "zerokit stage 3 + offload_optimizer + offload_param cpu"),
    "ds-z3-off": ("deepspeed", 3, "DeepSpeed ZeRO-3 + offload_optimizer cpu"),
}
DEFAULT_ROWS = list(ROWS)


def _offload_of(name: str) -> dict | None:
    if name.endswith(("-off", "-offp")):
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
    if args.worker.endswith("-offp"):  # the weight shards too (stage 3)
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    return cfg


def ds_config(args, stage):
    cfg = _base_ds_config(args, stage)
    cfg["optimizer"]["params"].pop("torch_adam", None)  # offload runs DeepSpeedCPUAdam
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


_base_zerokit_config, _base_ds_config = S.zerokit_config, S._ds_config
# bench_step's worker and row runner read these module globals: point them at this benchmark.
S.ROWS, S.zerokit_config, S._ds_config, S.__file__ = ROWS, zerokit_config, ds_config, __file__
S.DEFAULT_ROWS, S.GROUPS, S.__doc__ = DEFAULT_ROWS, {}, __doc__  # what --help says


def _peer(name: str) -> str | None:
    family, stage, _ = ROWS[name]
    return f"ds-z{stage}-off" if family == "zerokit" and name.endswith(("-off", "-dpu", "-offp")) else None


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


# ---- --hiding: how much of the host update the delayed update hides (world 1, two cores) ----------
HIDING = {"layers": 6, "width": 512, "heads": 8, "seq": 32, "micro_batch": 1, "rounds": 16,
          "steps_per_round": 10, "warmup": 3}


def _hiding_engine(delayed: bool):
    import torch
    import zerokit
    from zerokit.models import GPT, GPTConfig

    torch.manual_seed(1234)
    h = HIDING
    model = GPT(GPTConfig(n_layer=h["layers"], n_embd=h["width"], n_head=h["heads"],
                          block_size=h["seq"], vocab_size=256))
    off = {"device": "cpu", **({"delayed_update": {"enabled": True, "warmup_steps": 1}} if delayed else {})}
    cfg = {"train_micro_batch_size_per_gpu": h["micro_batch"],
           "optimizer": {"type": "AdamW", "params": dict(S.ADAMW)},
           "zero_optimization": {"stage": 2, "offload_optimizer": off}}
    engine, *_ = zerokit.initialize(model=model, config=cfg)
    kernel_s: dict[int, float] = {}
    step_fn = engine.offload._step_fn

    def pinned_and_timed(shard, group, coef):  # runs in the host worker thread
        os.sched_setaffinity(0, {1})  # Linux: pid 0 is the calling thread
        t0 = C.now()
        step_fn(shard, group, coef)
        n = engine.offload.launches
        kernel_s[n] = kernel_s.get(n, 0.0) + C.now() - t0
    engine.offload._step_fn = pinned_and_timed
    return engine, kernel_s


def run_hiding_worker(out_path: str) -> int:
    import json

    import torch

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {0})  # this (compute) thread: the stand-in for the device
    h = HIDING
    # "control" is a second no-delay engine: its difference from "no_delay" is the noise floor.
    engines = {"no_delay": _hiding_engine(False), "delay": _hiding_engine(True),
               "control": _hiding_engine(False)}
    g = torch.Generator().manual_seed(1)
    n = h["warmup"] + h["rounds"] * h["steps_per_round"]
    toks = [torch.randint(0, 256, (h["micro_batch"], h["seq"] + 1), generator=g) for _ in range(n)]
    times = {k: [] for k in engines}
    rounds = {k: [] for k in engines}  # per-round medians, for paired per-round fractions
    for name, (engine, _) in engines.items():
        for t in toks[:h["warmup"]]:
            engine.backward(engine(t[:, :-1].contiguous(), t[:, 1:].contiguous()))
            engine.step()
    for r in range(h["rounds"]):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))  # no order bias
        for name in order:
            engine = engines[name][0]
            batch = toks[h["warmup"] + r * h["steps_per_round"]:][:h["steps_per_round"]]
            mine = []
            for i, t in enumerate(batch):
                t0 = C.now()
                engine.backward(engine(t[:, :-1].contiguous(), t[:, 1:].contiguous()))
                engine.step()
                if i > 0:  # the first step of a round has no update in flight to overlap
                    mine.append(C.now() - t0)
            times[name] += mine
            rounds[name].append(C.summarize(mine)["median"])
            # Join an update still in flight before the other engine runs (it would overlap that
            # engine's steps instead), outside the clock.
            engine.offload.before_step()
    for engine, _ in engines.values():
        engine.destroy()
    kernel = [v for k, v in engines["no_delay"][1].items() if k > h["warmup"]]
    kernel_delay = [v for k, v in engines["delay"][1].items() if k > h["warmup"]]
    rec = {"step_s": {k: C.summarize(v) for k, v in times.items()}, "round_medians_s": rounds,
           "host_update_s": C.summarize(kernel), "host_update_s_delay_run": C.summarize(kernel_delay),
           "kernel_threads": torch.get_num_threads(), "setup": h}
    with open(out_path, "w") as f:
        json.dump(rec, f, indent=1)
    return 0


def run_hiding() -> int:
    import subprocess
    import tempfile

    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("--hiding needs two cores (one for the 'device', one for the host update)")
    machine = C.machine_info()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "hiding.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        subprocess.run([sys.executable, __file__, "--hiding-worker", out], env=env, check=True,
                       cwd=C.REPO_ROOT)
        import json

        rec = json.loads(Path(out).read_text())
    t_no, t_delay = rec["step_s"]["no_delay"]["median"], rec["step_s"]["delay"]["median"]
    t_host = rec["host_update_s"]["median"]
    hidden = (t_no - t_delay) / t_host
    rm = rec["round_medians_s"]
    per_round = sorted((a - b) / t_host for a, b in zip(rm["no_delay"], rm["delay"]))
    noise = sorted((a - b) / t_host for a, b in zip(rm["no_delay"], rm["control"]))
    rec.update(hidden_fraction=hidden, hidden_fraction_per_round=per_round,
               control_fraction_per_round=noise)
    h = HIDING

    def row(label, key, host):
        st = rec["step_s"][key]
        return [label, C.fmt_num(st["median"]), C.fmt_num(st["min"]), C.fmt_num(st["max"]), host]
    table = C.format_table(
        ["setting", "step s (median)", "min", "max", "host update s"],
        [row("offload, no delay", "no_delay", C.fmt_num(t_host)),
         row("offload + delayed update", "delay", C.fmt_num(rec["host_update_s_delay_run"]["median"])),
         row("offload, no delay (control)", "control", "")])
    print(f"bench_offload --hiding: world 1, GPT {h['layers']}x{h['width']} seq {h['seq']} mb "
          f"{h['micro_batch']}, fp32 AdamW, ZeRO-2 + offload ratio 1; compute 1 thread on core 0, host "
          f"update 1 thread on core 1; {h['rounds']} rounds x {h['steps_per_round']} steps per setting, "
          f"interleaved; {machine['cpu_model']}\n")
    print(table)
    print(f"\nhidden fraction = (t_no_delay - t_delay) / t_host_update = ({t_no:.4f} - {t_delay:.4f}) / "
          f"{t_host:.4f} = {100 * hidden:.0f}%")
    pct = lambda xs: ", ".join(f"{100 * x:.0f}%" for x in xs)  # noqa: E731
    print(f"per round (paired, sorted): {pct(per_round)}")
    print(f"control, the same formula with a second no-delay engine (noise floor): {pct(noise)}")
    rec["table"], rec["machine"] = table, machine
    path = C.write_json("bench_offload_hiding", {"benchmark": "bench_offload --hiding", **rec})
    print(f"\nwrote {path}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--hiding"]:
        return run_hiding()
    if argv[:1] == ["--hiding-worker"]:
        return run_hiding_worker(argv[1])
    args = S.parse_args(argv)
    if args.worker:
        return S.run_worker(args)
    unused = [flag for flag, given in (("--compare", args.compare), ("--zero3", args.zero3),
                                       ("--profile", args.profile)) if given]
    if unused:  # bench_step's options that this benchmark would otherwise drop silently
        raise SystemExit(f"bench_offload: {', '.join(unused)} is bench_step's; bench_offload takes "
                         f"--only, --rounds, --steps, --warmup, the model's sizes, --nproc and --out")
    names = [n.strip() for n in args.only.split(",")] if args.only else DEFAULT_ROWS
    for n in names:
        if n not in ROWS:
            raise SystemExit(f"unknown row {n!r}; rows: {', '.join(ROWS)}")
    machine = C.machine_info()
    print(f"bench_offload: {len(names)} rows, {args.nproc} gloo ranks x 1 thread, GPT {args.layers}x"
          f"{args.width} seq {args.seq} mb {args.micro_batch}, {args.warmup} warm-up + {args.steps} "
          f"timed steps, {args.rounds} round(s); {machine['cpu_model']}, {machine['cpu_count']} cpus", flush=True)
    results = S.run_rounds(names, args)
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
