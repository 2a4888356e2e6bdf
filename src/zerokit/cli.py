"""The `zerokit` command: `zerokit train` (the demo), `zerokit convert` (a checkpoint to
safetensors), `zerokit estimate` (bytes per rank per tier, before anything is allocated) and
`zerokit plot` (a step's memory timeline as a PNG).

    torchrun --standalone --nproc-per-node 2 --no-python zerokit train --stage 2 --steps 200
    zerokit estimate gpt-1b --world-size 4 --dtype bf16
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train the built-in GPT on the standard library's source text")
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2], help="ZeRO stage")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--steps-per-print", type=int, default=10,
                   help="the engine's step=N progress line every this many steps (above the bar)")
    p.add_argument("--config", help="a DeepSpeed-style JSON file; its keys override the flags'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-plot", help="write the last step's memory timeline here (PNG; its "
                                         "data beside it as .json)")


def _config(args) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.1,
                                                  "betas": [0.9, 0.95]}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": args.steps, "warmup_num_steps": max(2, args.steps // 20),
                                 "warmup_type": "linear", "cos_min_ratio": 0.1}},
        "gradient_clipping": 1.0,
        "steps_per_print": args.steps_per_print,
        "bf16": {"enabled": args.dtype == "bf16"},
        "zero_optimization": {"stage": args.stage},
    }
    if args.config:
        with open(args.config) as f:
            cfg.update(json.load(f))
    return cfg


def train(args) -> int:
    import psutil
    import torch
    from tqdm import tqdm

    import zerokit
    from zerokit.data import ByteDataset, stdlib_text
    from zerokit.models import GPT, GPTConfig

    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width))
    dataset = ByteDataset(stdlib_text(), args.seq)
    engine, _, loader, _ = zerokit.initialize(model=model, config=_config(args), training_data=dataset)
    rank, world = engine.comm.rank, engine.comm.world_size
    if rank == 0:  # initialize has shown the plan (rank 0, the "zerokit" logger)
        print(f"data: {len(dataset.data):,} bytes of Python standard-library source, "
              f"{len(dataset):,} windows of {args.seq}", flush=True)
    tokens_per_step = engine.train_batch_size() * args.seq
    batches = _forever(loader)
    bar = tqdm(total=args.steps, disable=rank != 0, unit="step", dynamic_ncols=True, file=sys.stdout)
    first = last = None
    ema = None
    start = time.perf_counter()
    with _log_lines_above(bar):  # steps_per_print lines print above the bar, not through it
        for step in range(args.steps):
            t0 = time.perf_counter()
            step_loss = 0.0
            for _ in range(engine.gradient_accumulation_steps()):
                x, y = next(batches)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                step_loss += loss.item() / engine.gradient_accumulation_steps()
            ema = step_loss if ema is None else 0.9 * ema + 0.1 * step_loss
            first = step_loss if first is None else first
            last = ema
            dt = time.perf_counter() - t0
            bar.set_postfix(_bar_postfix(engine, ema, tokens_per_step / dt))
            bar.update(1)
    bar.close()
    elapsed = time.perf_counter() - start
    rss = psutil.Process().memory_info().rss
    peak = _peak_rss()
    reports = [None] * world
    report = (engine.memory_report(peak=True), rss, peak)
    if world > 1:
        torch.distributed.all_gather_object(reports, report)
    else:
        reports = [report]
    if rank == 0:
        print(f"\ntrained {args.steps} steps in {elapsed:.1f}s ({tokens_per_step * args.steps / elapsed:,.0f} "
              f"tokens/s on {world} rank(s)); loss {first:.3f} -> {last:.3f} "
              f"(uniform guess: {math.log(256):.3f})")
        for r, (text, now, top) in enumerate(reports):
            print(f"\n{text}\n  process RSS on rank {r}: {now / 2**20:,.0f} MiB now, {top / 2**20:,.0f} MiB peak")
        if args.memory_plot:
            _write_timeline(engine.memory_timeline(), args.memory_plot)
    engine.destroy()
    return 0


def _write_timeline(timeline, png: str) -> None:
    """Rank 0's last step as JSON and, with matplotlib installed, as a PNG; says where."""
    import os

    data = os.path.splitext(png)[0] + ".json"
    timeline.save(data)
    try:
        from zerokit.memory.plot import plot_timeline

        plot_timeline(timeline, png, "zerokit train: rank 0, last step")
        print(f"memory timeline of the last step: {os.path.abspath(png)} (data: "
              f"{os.path.abspath(data)}){_rss_peak(timeline)}")
    except ImportError as e:
        print(f"memory timeline of the last step: {os.path.abspath(data)}{_rss_peak(timeline)}; no PNG: {e}")


def _rss_peak(timeline) -> str:
    """The step's sampled RSS peak and its phase, to end the timeline's line ('' unsampled)."""
    found = timeline.rss_peak()
    return f"; RSS peak {found[0] / 2**20:,.0f} MiB ({found[1]})" if found else ""


def _bar_postfix(engine, loss: float, tokens_per_s: float) -> dict[str, str]:
    """What the bar shows after each step; with NVMe offload also the step's I/O (bytes moved,
    the rate achieved, and how long the step waited on it), the numbers memory_report prints."""
    shown = {"loss": f"{loss:.3f}", "tok_s": f"{tokens_per_s:,.0f}", "lr": f"{engine.get_lr()[0]:.2e}"}
    io = engine.nvme_io()
    if io:
        from zerokit.engine.host_budget import size

        moved = size(int(io["bytes_read"] + io["bytes_written"]))
        shown["nvme"] = f"{moved} at {io['gb_per_s']:.2f} GB/s, waited {io['wait_s']:.2f}s"
    return shown


def _log_lines_above(bar):
    """zerokit's own stderr handler (rank 0, logs.py) writes through tqdm while the bar runs."""
    import contextlib
    import logging

    from tqdm.contrib.logging import logging_redirect_tqdm

    from zerokit.logs import default_handler

    zerokit_log = logging.getLogger("zerokit")
    if bar.disable or default_handler(zerokit_log) is None:
        return contextlib.nullcontext()
    return logging_redirect_tqdm([zerokit_log])


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _forever(loader):
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def _convert_parser(sub) -> None:
    p = sub.add_parser("convert", help="write a checkpoint's model as safetensors (Hugging Face layout)")
    p.add_argument("checkpoint", help="the save_checkpoint directory (tag from 'latest') or a tag directory")
    p.add_argument("out", help="output directory")
    p.add_argument("--tag", help="the tag to convert (default: the one 'latest' names)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--max-shard-size", type=float, default=5.0, help="GiB per file before sharding")


def convert(args) -> int:
    from zerokit.checkpoint.consolidate import convert as run
    from zerokit.engine.precision import DTYPES

    files = run(args.checkpoint, args.out, DTYPES[args.dtype], tag=args.tag,
                max_shard_bytes=int(args.max_shard_size * 2**30))
    print("\n".join(files))
    return 0


def _estimate_parser(sub) -> None:
    p = sub.add_parser("estimate", help="bytes per rank per tier for each stage and offload choice, "
                                        "without allocating the model")
    p.add_argument("model", help="a built-in shape (demo, gpt-125m, gpt-1b, gpt-3b), a transformers "
                                 "model name or directory with a local config.json")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq", type=int, help="tokens per sample (default: the model's longest)")
    p.add_argument("--config", help="a DeepSpeed-style JSON file: one row for exactly that config")
    p.add_argument("--cpu", action="store_true", help="the compute device is the CPU (no pinned "
                                                      "staging buffers)")


def estimate(args) -> int:
    from zerokit.memory import estimate as one, estimate_grid
    from zerokit.memory.report import format_grid, format_one

    common = {"dtype": args.dtype, "micro_batch": args.micro_batch, "seq_len": args.seq,
              "cuda": not args.cpu}
    if args.config:
        with open(args.config) as f:
            config = json.load(f)
        print(format_one(one(args.model, args.world_size, config, **common)))
        return 0
    print(format_grid(estimate_grid(args.model, args.world_size, **common),
                      f"zerokit estimate: {args.model}, {args.dtype}, micro-batch {args.micro_batch}"))
    return 0


def _plot_parser(sub) -> None:
    p = sub.add_parser("plot", help="draw a memory timeline (engine.memory_timeline().save(path)) as a PNG")
    p.add_argument("timeline", help="the timeline's JSON file")
    p.add_argument("-o", "--out", help="the PNG to write (default: the JSON's name with .png)")


def plot(args) -> int:
    import os

    from zerokit.memory.plot import plot_timeline
    from zerokit.tiers.timeline import MemoryTimeline

    out = args.out or os.path.splitext(args.timeline)[0] + ".png"
    print(plot_timeline(MemoryTimeline.load(args.timeline), out, os.path.basename(args.timeline)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zerokit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _convert_parser(sub)
    _estimate_parser(sub)
    _plot_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "train":
        return train(args)
    if args.command == "convert":
        return convert(args)
    if args.command == "estimate":
        return estimate(args)
    if args.command == "plot":
        return plot(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
