#!/usr/bin/env python
"""The NVMe stream's access pattern at sector-aligned and unaligned file offsets.

    flock /tmp/zk-heavy.lock .venv/bin/python benchmarks/bench_aio_residue.py [--rounds 3]

The optimizer stream (parts/nvme_executor.py) moves each sub-group between a 4096-aligned host
buffer and its files at byte offset lo x element size. O_DIRECT takes a block straight only where
the file offset and the address agree modulo 4096 (io/aio.py [Note: file residue]); otherwise the
I/O engine stages it through a bounce buffer on its thread pool, and a staged write reads its
partial edge sectors back first. This measures that difference on the disk: `--pieces` pieces of
`--piece-mb` MB, four buffers in flight (the stream's buffer sets), written then read back, at
offsets k x 40,001,536 bytes (a multiple of 4096: what sector-aligned sub-groups give, see
[Note: sector-aligned sub-groups]) and k x 40,000,000 (bench_infinity's sub_group_size 10,000,000
fp32 elements before it was rounded). Rows alternate within each round; each row reports its
median GB/s and the engine's block paths (kernel AIO vs staged on threads). aio settings are
bench_infinity's (block 1 MiB, queue depth 16, one thread). Writes benchmarks/results/
bench_aio_residue-<time>.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import format_table, machine_info, write_json  # noqa: E402
from zerokit.io import AioConfig, AsyncIO, aligned_empty  # noqa: E402

ALIGNED, UNALIGNED = 40_001_536, 40_000_000
IN_FLIGHT = 4


def move(io: AsyncIO, path: str, stride: int, pieces: int, write: bool) -> tuple[float, dict]:
    """GB/s of `pieces` pieces of `stride` bytes at offsets k x stride, and the blocks by path."""
    bufs = [aligned_empty(stride) for _ in range(IN_FLIGHT)]
    for b in bufs:
        b.fill_(7)
    before = io.block_counts()
    t0 = time.perf_counter()
    handles = []
    for k in range(pieces):
        if len(handles) >= IN_FLIGHT:
            handles.pop(0).wait()
        b = bufs[k % IN_FLIGHT]
        handles.append(io.write(path, b, offset=k * stride, fsync=k == pieces - 1) if write
                       else io.read(path, b, offset=k * stride))
    for h in handles:
        h.wait()
    seconds = time.perf_counter() - t0
    after = io.block_counts()
    return pieces * stride / seconds / 1e9, {k: after[k] - before[k] for k in after}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(__file__), "..", ".bench_nvme"))
    ap.add_argument("--pieces", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    io = AsyncIO(AioConfig(block_size=1 << 20, queue_depth=16, thread_count=1))
    rows = {(name, op): [] for name in ("aligned", "unaligned") for op in ("write", "read")}
    paths = {}
    try:
        for r in range(args.rounds):
            order = [("aligned", ALIGNED), ("unaligned", UNALIGNED)]
            if r % 2:
                order.reverse()
            for op in ("write", "read"):
                for name, stride in order:
                    path = paths.setdefault(name, os.path.join(args.dir, f"residue-{name}.bin"))
                    gbs, blocks = move(io, path, stride, args.pieces, op == "write")
                    rows[name, op].append({"gb_s": gbs, "blocks": blocks})
                    print(f"round {r}: {op:5s} {name:9s} {gbs:.2f} GB/s {blocks}", flush=True)
    finally:
        io.close()
        for p in paths.values():
            if os.path.exists(p):
                os.unlink(p)
    table = []
    for (name, op), runs in rows.items():
        table.append([op, name, f"{statistics.median(x['gb_s'] for x in runs):.2f}",
                      " ".join(f"{x['gb_s']:.2f}" for x in runs),
                      runs[-1]["blocks"]["kernel"], runs[-1]["blocks"]["threads"]])
    table.sort(key=lambda row: (row[0] != "write", row[1]))
    print(format_table(["op", "file offsets", "median GB/s", "each round", "kernel blocks",
                        "staged blocks"], table))
    path = write_json("bench_aio_residue", {
        "benchmark": "bench_aio_residue", "argv": sys.argv[1:], "machine": machine_info(),
        "strides": {"aligned": ALIGNED, "unaligned": UNALIGNED}, "pieces": args.pieces,
        "rows": {f"{op}/{name}": runs for (name, op), runs in rows.items()}}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
