#!/usr/bin/env python
"""ZeRO-Infinity on one rank: zerokit vs DeepSpeed, parameters and optimizer state on NVMe.

    flock /tmp/zk-heavy.lock .venv/bin/python benchmarks/bench_infinity.py                 # 125m, 1b
    python benchmarks/bench_infinity.py --models 125m,1b,3b --rows ds-inf,zk-inf,zk-inf-half
    python benchmarks/bench_infinity.py --models 4b --rows zk-inf-8g                       # the largest
    python benchmarks/bench_infinity.py --models 125m --rows ds-inf,zk-inf,zk-inf-bf16,zk-inf-ds,zk-inf-ds-bf16
    python benchmarks/bench_infinity.py --models 7b --rows zk-inf-files-bf16 --steps 2   # 7B: bf16 files only
    python benchmarks/bench_infinity.py --models 1b --rows zk-inf-half,hand-x --hand x=JSON --rounds 2

The issue's setup (#16): GPT (nanoGPT shape, vocab 32000) at stage 3, parameters and optimizer
state on NVMe, bf16, AdamW, seq 128, micro-batch 1, one rank, 2 intra-op threads. Each model is
built inside the library's own `zero.Init(remote_device="nvme")`, so neither side materialises
the whole model in RAM first. Each row is its own process (so peak RSS is that row's alone):
  ds-inf       DeepSpeed 0.19 ZeRO-Infinity (CPU accelerator, its async_io op: needs libaio-dev)
  zk-inf       zerokit, DeepSpeed's placement: weights, master, gradients and optimizer state on
               NVMe, nothing kept in host memory; DeepSpeed's config with zerokit's stream keys,
               so offload_optimizer.step_in_backward is zerokit's default (on: the speculative
               step, each unit's gradient held in host memory until its part steps while backward
               goes on, instead of going to a file)
  zk-inf-files zk-inf with step_in_backward false: gradients written to NVMe files in backward,
               the whole stream in step()
  zk-inf-sib   zk-inf with step_in_backward true, set explicitly
  zk-inf-ds    zerokit, host budget = DeepSpeed's peak RSS at that size (from this run, or
               --ds-rss-gib)
  zk-inf-half  zerokit, host budget = half of that
  zk-inf-8g    zerokit, host budget 8 GiB (the "largest model that trains here" row)
  zk-inf-4g    zerokit, host budget 4 GiB
  hand-LABEL   --hand LABEL=JSON: the zk-inf config with JSON merged in, tuned by hand (issue
               #28); a third table sets each budgeted row beside the fastest hand row whose peak
               RSS fits its budget
  zk-opt-nvme  zerokit, 16-bit weights in host memory (offload_param cpu), master, gradients and
               optimizer state on NVMe (works without NVMe weights)
  zk-inf-ds-dpu zk-inf-ds with the one-step delayed update (offload_optimizer.delayed_update):
               the step's NVMe stream overlaps the next forward and backward. Changes the math
               (weights one step stale), so it is a row of its own, never compared as equal.
  zk-inf-ds-clip zk-inf-ds with gradient_clipping 1e-3, whatever --clipping says: clipping applies
               at every step, so the first update stepped in backward is redone and, speculation
               being adaptive (offload_optimizer.speculation), the later steps are held back
               (stepped in step()); the "redo" column says what the redos cost per timed
               step, and in brackets the warm-up's (where the first redo falls). Where the
               planner does not step in backward (the byte rules' hold for a redo does not fit
               the budget), nothing is speculated and the column says 0/0.
  <row>-bf16   any zerokit row above with bf16.bf16_master_weights_and_grads + bf16_optimizer_states
               (issue #27): the same placement keys and budget, 2-byte master, gradient and state
               files (e.g. zk-inf-bf16, zk-inf-ds-bf16). A second table sets each beside its
               fp32-state row of the same run: bytes read and written per step, disk, s/step.
Models: 125m, 1b, 3b, 4b and 7b (7.11B). Disk, by expected_disk_bytes: zk-inf-files 16 B per
parameter at accumulation 1 (bf16 weights 2, fp32 master 4, bf16 gradients 2, moments 8; the
gradients fp32, 18 B, with accumulation, and in ds-inf), zk-inf-files-bf16 10 (2 + 2 + 2 + 4), a
row stepping in backward (zk-inf, -sib) 26 / 14 (no gradient files, but a second slot of
master and moments). At 4b zk-inf-files needs 69.6 GB (64.8 GiB). At 7b only the -bf16 rows not stepping in backward fit this VM's disk:
zk-inf-files-bf16 needs 71.1 GB (66.2 GiB) of 76.5 GiB free, passing the default --min-free-gib
10 by ~0.3 GiB; a budgeted -bf16 row (zk-inf-8g-bf16) as much if its planner does not step in
backward (if it does: 14 B per parameter, 99.5 GB, more than the disk holds; not tried).
Both sides take `gradient_clipping` (--clipping, default 1.0: DeepSpeed's default; 0 turns it off)
and `gradient_accumulation_steps` (--accumulation, default 1): a timed step is that many
micro-steps (forward, backward, step() each), and tokens/s counts all of them.
Each row waits for the disk to settle twice: before its worker starts (the previous row's files,
or dd's, were just written and removed) and in the worker between setup (tens of GB of files
written) and the first warm-up step. This VM's disk is slow for minutes after a burst of writes
(docs/nvme.md): rows started straight after one meet it in different states, and their ratios
are noise.
The wait polls the disk's own counters and ends once it has written nothing and had nothing in
flight for --settle-quiet-s seconds in a row (default 30), or after --settle-max-s (default 120;
0: no wait); the row's note gives the seconds waited, and says where the swap folder has no block
device to watch (tmpfs).
The budgeted rows (zk-inf-ds, zk-inf-half, zk-inf-8g, zk-inf-4g, and the -dpu and -clip variants) pass
`memory.host` and nothing else: DeepSpeed's config (ds-inf's) with offload_optimizer.device and
offload_param.device "auto" (the swap folder as their nvme_path), and max_in_cpu, buffer counts,
the Twin-Flow ratio, step_in_backward, sub_group_size and the stream's pipelining left out, so
zerokit's placement planner (engine/planner.py, engine/size_plan.py) chooses them at initialize
from the budget, the model's units and the bandwidths it measured (its choice and the candidates
it weighed are in the row's log). The model is built on NVMe
(zero.Init remote_device "nvme") and placed by initialize. Both sides build the model in bf16
(zero.Init dtype).

Measured outside the libraries under test: step time (wall clock around forward+backward+step),
peak RSS (the kernel's high-water mark, VmHWM, reset per phase: setup, forward, backward,
step(); the run's peak is the largest, and the table's note gives setup's and the steps' apart),
bytes read and written per step (/proc/self/io read_bytes/write_bytes: what reached the block
device, not the page cache), bytes on disk under the swap folder (du) and the
disk's own sequential bandwidth, measured in the same run with `dd` and O_DIRECT. A zerokit row's
step lines (in its log) also give the most RAM its ledger counted at once in the step, with the
phase and the bytes per tier and kind then (the library's own figure, beside the measured RSS
peaks: the difference is what no byte rule counts). Prints a table and writes benchmarks/results/bench_infinity-<time>.json (and -latest.json).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from _engine_counters import (disk_idle as _disk_idle, ledger_ram_peak as _ledger_ram_peak,  # noqa: E402
                              redo as _redo, speculation as _speculation)

GiB = 1 << 30
MODELS = {  # name -> (n_layer, n_embd, n_head)
    "125m": (12, 768, 12),
    "1b": (24, 1792, 14),
    "3b": (32, 2560, 20),
    "4b": (40, 2944, 23),  # 4.35B: 16 B of states per parameter = 69.6 GB, 2.75x this VM's 23.5 GiB
    # 7.11B (LLaMA-7B's width and heads, 34 layers): only the -bf16 rows fit a 77 GiB disk, see
    # expected_disk_bytes (zk-inf-bf16: 10 B per parameter = 71.1 GB; fp32 states: 18 B = 128 GB)
    "7b": (34, 4096, 32),
}
VOCAB, SEQ, MICRO = 32000, 128, 1
ADAMW = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
ROWS = {
    "ds-inf": ("deepspeed", None, "DeepSpeed ZeRO-Infinity"),
    "zk-inf": ("zerokit", None, "zerokit, everything on NVMe"),
    "zk-inf-files": ("zerokit", None, "zerokit, everything on NVMe, gradients in files"),
    "zk-inf-sib": ("zerokit", None, "zerokit, everything on NVMe, stepping in backward"),
    "zk-inf-ds": ("zerokit", "ds", "zerokit, host budget = DeepSpeed RSS"),
    "zk-inf-half": ("zerokit", "half", "zerokit, host budget = DeepSpeed RSS / 2"),
    "zk-inf-8g": ("zerokit", 8.0, "zerokit, host budget 8 GiB"),
    "zk-inf-4g": ("zerokit", 4.0, "zerokit, host budget 4 GiB"),
    "zk-opt-nvme": ("zerokit", "weights", "zerokit, weights in RAM, optimizer on NVMe"),
    "zk-inf-ds-dpu": ("zerokit", "ds", "zerokit, host budget = DeepSpeed RSS, delayed update"),
    "zk-inf-ds-clip": ("zerokit", "ds", "zerokit, host budget = DeepSpeed RSS, clipping always applies"),
}
# Each zerokit row's twin with bf16 master, gradients and optimizer state (issue #27:
# bf16.bf16_master_weights_and_grads + bf16_optimizer_states): the same placement keys and budget,
# 2-byte master, gradient and state files and stream buffers instead of 4-byte ones.
BF16 = "-bf16"
ROWS.update({name + BF16: (family, budget, label + ", bf16 master + states")
             for name, (family, budget, label) in list(ROWS.items()) if family == "zerokit"})
# Rows tuned by hand (--hand LABEL=JSON, issue #28's comparison): "hand-LABEL" -> the keys merged
# into the unbudgeted (all-NVMe) zerokit config; registered in ROWS by parse_args.
HAND = "hand-"
ROW_CLIPPING = {"zk-inf-ds-clip": 1e-3}  # rows whose gradient_clipping is their own, not --clipping
# Weight shards the unbudgeted zerokit rows read ahead (offload_param.buffer_count; the DeepSpeed
# row needs 16, see ds_config), each up to the embedding's size.
ZK_PARAM_BUFFERS = 4
ZK_SUB_GROUP = 10_000_000  # streamed as 9,998,336 (sector-aligned: StreamSettings.group_numel); 4 sets x 4 files x ~40 MB
# Elements per reduce bucket for zerokit rows: two buckets of fp32 gradients may be in flight
# (engine._max_pending_bytes), 4 GB at DeepSpeed's default 5e8; 5e7 keeps that at 400 MB.
ZK_REDUCE_BUCKET = 50_000_000
WORKER_ENV = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "DS_ACCELERATOR": "cpu",
              "PYTHONUNBUFFERED": "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
              "MASTER_ADDR": "127.0.0.1"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="125m,1b", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--rows", default="ds-inf,zk-inf,zk-inf-ds,zk-inf-half", help=f"of {', '.join(ROWS)}")
    p.add_argument("--steps", type=int, default=3, help="timed steps per row (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every row this many times, the rows' order reversed every other "
                        "round (so no row always follows the same one); a row's s/step is the "
                        "median of its rounds' medians, each round's in the 'rounds' column "
                        "(default 1; the disk's pace moves 10-15%% between runs of the same keys)")
    p.add_argument("--clipping", type=float, default=1.0,
                   help="gradient_clipping on both sides (default 1.0, DeepSpeed's; 0: none)")
    p.add_argument("--sub-group", type=int, default=ZK_SUB_GROUP,
                   help=f"the unbudgeted zerokit rows' sub_group_size: elements per NVMe stream "
                        f"request (default {ZK_SUB_GROUP:,}; host buffers: 4 sets x 4 to 4.5 x 4 B "
                        f"x this); the budgeted rows leave it to the planner")
    p.add_argument("--accumulation", type=int, default=1,
                   help="gradient_accumulation_steps on both sides (default 1; the issue's rows: 1 and 4)")
    p.add_argument("--nvme-dir", default=None, help="swap folder parent (default: a temporary "
                                                     "folder on the disk holding the repository)")
    p.add_argument("--ds-rss-gib", type=float, default=None,
                   help="DeepSpeed's peak RSS for zk-inf-half when ds-inf is not in this run")
    p.add_argument("--min-free-gib", type=float, default=10.0,
                   help="refuse a row whose expected disk use leaves less free (default 10)")
    p.add_argument("--row-timeout", type=float, default=3600.0)
    p.add_argument("--settle-quiet-s", type=float, default=30.0,
                   help="before a row and before its timed steps, wait until the disk has written "
                        "nothing for this long (default 30)")
    p.add_argument("--settle-max-s", type=float, default=120.0,
                   help="but wait no longer than this (default 120; 0: no wait)")
    p.add_argument("--hand", action="append", default=[], metavar="LABEL=JSON",
                   help="a zerokit row tuned by hand, run after --rows as 'hand-LABEL': JSON is "
                        "merged into the all-NVMe config (e.g. '{\"zero_optimization\": "
                        "{\"offload_param\": {\"device\": \"cpu\"}}}'); each budgeted row is "
                        "compared with the fastest hand row whose peak RSS fits its budget")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget-gib", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--weights-in-ram", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--delayed", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--step-in-backward", choices=("on", "off"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--bf16-state", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--swap", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--overrides", default=None, help=argparse.SUPPRESS)  # a hand row's JSON
    args = p.parse_args(argv)
    args.hand_keys = {}
    for spec in args.hand:
        label, _, text = spec.partition("=")
        try:
            keys = json.loads(text)
        except json.JSONDecodeError as e:
            p.error(f"--hand {spec!r}: the JSON after '=' does not parse ({e})")
        if not label or not isinstance(keys, dict):
            p.error(f"--hand {spec!r}: give LABEL=JSON with a JSON object, e.g. "
                    f"cpu='{{\"zero_optimization\": {{\"offload_param\": {{\"device\": \"cpu\"}}}}}}'")
        args.hand_keys[HAND + label] = keys
        ROWS[HAND + label] = ("zerokit", None, f"zerokit by hand: {text}")
    if args.worker and args.worker.startswith(HAND):  # a hand row's worker: its keys come alone
        ROWS.setdefault(args.worker, ("zerokit", None, "zerokit by hand"))
    if args.clipping < 0:
        p.error(f"--clipping: {args.clipping} is negative; give 0 (none) or a positive norm")
    if args.accumulation < 1:
        p.error(f"--accumulation: {args.accumulation}; give 1 or more micro-steps per step")
    if args.rounds < 1:
        p.error(f"--rounds: {args.rounds}; give 1 or more")
    if args.settle_quiet_s < 0:
        p.error(f"--settle-quiet-s: {args.settle_quiet_s} is negative")
    if args.settle_max_s < 0:
        p.error(f"--settle-max-s: {args.settle_max_s} is negative; give 0 for no wait")
    return args


def n_params(model: str) -> int:
    layers, width, _ = MODELS[model]
    block = 12 * width * width + 13 * width  # attention 4w^2+4w, MLP 8w^2+5w, two LayerNorms 4w
    return layers * block + 2 * VOCAB * width + SEQ * width + 2 * width  # untied head


def expected_disk_bytes(model: str, row: str, accumulation: int = 1) -> int:
    """Files per parameter, at most: bf16 weight shards (2 B), the master and Adam's two moments
    (fp32: 4 + 8; a -bf16 row: 2 + 4) and the gradient files (DeepSpeed: the master's dtype, 4 /
    2; zerokit at accumulation 1: bf16, 2, offload_optimizer.gradient_dtype 'auto'). A row
    stepping in backward (zk-inf, -sib) has no gradient files but the speculative step's second
    slot of master and moments (engine/assemble.py _check_nvme): zerokit fp32 16 (accumulation >
    1: 18) / -sib 26 B, -bf16 10 / -sib 14 B; DeepSpeed 18. The budgeted rows are counted without
    stepping in backward (the planner may choose it and keep part of the model in RAM;
    zerokit's own disk check refuses a plan the disk cannot hold)."""
    m = 2 if _bf16_state(row) else 4  # master bytes per element; moments 2 m
    zerokit = ROWS[row][0] == "zerokit"
    grad = 2 if zerokit and accumulation == 1 else m
    # None: zerokit's default, on (a zerokit row without a budget)
    sib = zerokit and not _budgeted(row) and _steps_in_backward(row) is not False
    files = 2 + m + 2 * m + (m + 2 * m if sib else grad)
    return files * n_params(model)


def _base(row: str) -> str:
    """The row without its -bf16 suffix (the fp32-state row it is the twin of)."""
    return row[: -len(BF16)] if row.endswith(BF16) else row


def _bf16_state(row: str) -> bool:
    return row.endswith(BF16)


def _steps_in_backward(row: str) -> bool | None:
    """offload_optimizer.step_in_backward as the row sets it: -sib on, -files off; None: left
    out (zerokit's default, on, for zk-inf and the hand rows; the planner's choice for the
    budgeted rows)."""
    base = _base(row)
    return True if base.endswith("-sib") else False if base.endswith("-files") else None


def _budgeted(row: str) -> bool:
    return ROWS[row][0] == "zerokit" and ROWS[row][1] not in (None, "weights")


# ===================================================================================== worker
class NotAvailable(Exception):
    pass


def _gpt_config(model: str):
    from zerokit.models import GPTConfig

    layers, width, heads = MODELS[model]
    # Untied head: DeepSpeed 0.19.8's NVMe parameter swapper leaks a buffer per step on a tied
    # weight ("Not enough buffers 0 for swapping 1" at the second step).
    return GPTConfig(n_layer=layers, n_embd=width, n_head=heads, block_size=SEQ, vocab_size=VOCAB,
                     tie_weights=False)


def _io_counters() -> tuple[int, int]:
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


# A step is marked stalled when the disk, while busy, moved less than this share of dd's slower
# direction: this VM's disk at times serves ~1 MiB requests at 4-390 MB/s for tens of seconds
# against its usual 0.8-1.7 GB/s, whatever the row (docs/nvme.md, "The disk stalls at times").
STALL_SHARE = 0.4


def block_stat_path(folder: Path) -> Path | None:
    """The kernel's counters (/sys/dev/block/MAJ:MIN/stat) of the block device holding `folder`;
    None on a filesystem with no block device (tmpfs, overlay)."""
    dev = os.stat(folder).st_dev
    path = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return path if os.major(dev) and path.exists() else None


def _block_stat(path: Path) -> list[int]:
    """The stat file's fields (Documentation/block/stat.rst): 2 sectors read, 6 sectors written,
    8 requests in flight, 9 io_ticks."""
    return [int(x) for x in path.read_text().split()]


def block_counters(path: Path | None) -> tuple[int, float] | None:
    """(bytes read + written, seconds busy) since boot: sectors are 512 bytes whatever the
    device's, io_ticks counts milliseconds with at least one request in flight."""
    if path is None:
        return None
    f = _block_stat(path)
    return (f[2] + f[6]) * 512, f[9] / 1e3


def disk_pace(before, after) -> dict | None:
    """The device's bytes and busy seconds over a step, and its pace while busy (GB/s)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    moved, busy = after[0] - before[0], after[1] - before[1]
    return {"gb": moved / 1e9, "busy_s": busy, "gb_s": moved / busy / 1e9}


def write_counters(path: Path | None) -> tuple[int, int] | None:
    """(sectors written since boot, requests in flight now) of the block device at `path`."""
    if path is None:
        return None
    f = _block_stat(path)
    return f[6], f[8]


def settle(sample, quiet_s: float, max_s: float, clock=time.monotonic, sleep=time.sleep,
           poll_s: float = 1.0) -> dict | None:
    """Wait until the disk has written nothing and had nothing in flight for `quiet_s` seconds in
    a row, or for `max_s` seconds at most: this VM's disk runs at a fraction of its pace for
    minutes after a burst of writes (docs/nvme.md), so a row started straight after one is timed
    against a slower disk than its peers. `sample()` gives (sectors written, requests in flight),
    or None where there is no block device to watch. Returns {"waited_s", "settled"} (settled
    False: gave up at max_s), or None when there was no wait (max_s 0, or nothing to sample)."""
    if max_s <= 0:
        return None
    last = sample()
    if last is None:
        return None
    start = quiet_since = clock()
    while True:
        now = clock()
        if now - quiet_since >= quiet_s:
            return {"waited_s": now - start, "settled": True}
        if now - start >= max_s:
            return {"waited_s": now - start, "settled": False}
        sleep(poll_s)
        counters = sample()
        if counters[0] != last[0] or counters[1]:  # a write since the last look, or one under way
            quiet_since = clock()
        last = counters


def ds_config(swap: str, model: str, clipping: float = 1.0, accumulation: int = 1) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clipping, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": dict(ADAMW)},
        "zero_optimization": {
            # Small tensors (LayerNorms, biases) stay in memory (DeepSpeed's default threshold),
            # and the prefetch is one embedding's worth: DeepSpeed's parameter swapper holds one
            # whole buffer per parameter in flight and fails when its default 5e7-element prefetch
            # asks for more than buffer_count of them (DeepSpeed #3062).
            "stage": 3, "sub_group_size": 100_000_000, "stage3_param_persistence_threshold": 100_000,
            "stage3_prefetch_bucket_size": VOCAB * MODELS[model][1],
            # and nothing kept gathered for reuse: with the default reuse distance (1e9) the
            # weights gathered at the end of a backward hold their swap buffers into the next step.
            "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 2 * VOCAB * MODELS[model][1],
            # DeepSpeed's parameter swapper needs a buffer (of at least the largest parameter: the
            # embedding) per parameter in flight; 5 (its default) runs out at the second step.
            "offload_param": {"device": "nvme", "nvme_path": swap, "buffer_count": 16,
                              "buffer_size": VOCAB * MODELS[model][1], "max_in_cpu": 0,
                              "pin_memory": False},
            # pipeline_read/write stay False (DeepSpeed's default): 0.19.8's pipelined swapper
            # fails an assertion in swap_out_optimizer_state on the CPU accelerator.
            "offload_optimizer": {"device": "nvme", "nvme_path": swap, "buffer_count": 4,
                                  "pipeline_read": False, "pipeline_write": False, "fast_init": False,
                                  "pin_memory": False},
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 16, "intra_op_parallelism": 1,
                "single_submit": False, "overlap_events": True},
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }


def zk_config(swap: str, model: str, budget_gib: float | None, weights_in_ram: bool = False,
              delayed: bool = False, clipping: float = 1.0, accumulation: int = 1,
              step_in_backward: bool | None = None, sub_group: int = ZK_SUB_GROUP,
              bf16_state: bool = False, overrides: dict | None = None) -> dict:
    """zerokit's config: DeepSpeed's, with zerokit's stream settings. With a budget: memory.host
    and the offload devices "auto", every placement key left to the planner; without one,
    everything on NVMe (weights_in_ram: the weights in host memory), nothing kept in RAM.
    bf16_state: bf16 master, gradients and optimizer state (the -bf16 rows).
    overrides: a hand row's keys, merged into the all-NVMe config (a None value removes a key)."""
    cfg = ds_config(swap, model, clipping, accumulation)
    if bf16_state:
        cfg["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    zero = cfg["zero_optimization"]
    off, param = zero["offload_optimizer"], zero["offload_param"]
    if delayed:  # ZeRO-Offload's one-step delayed update, after one normal step
        off["delayed_update"] = {"enabled": True, "warmup_steps": 1}
    if budget_gib is not None:
        # The budget and nothing else (#28 point 4): the placement, its buffer counts, the
        # stream's sub-group and pipelining (zerokit's default: on) and the reduction bucket
        # are left to initialize's planner (engine/planner.py, engine/size_plan.py).
        cfg["memory"] = {"host": int(budget_gib * GiB)}
        zero.pop("sub_group_size")
        for section in (off, param):
            for key in ("buffer_count", "buffer_size", "max_in_cpu", "pipeline_read",
                        "pipeline_write"):
                section.pop(key, None)
            section["device"] = "auto"
        return cfg
    zero["sub_group_size"] = sub_group
    zero["reduce_bucket_size"] = ZK_REDUCE_BUCKET
    off.update(pipeline_read=True, pipeline_write=True)
    off.update(max_in_cpu=0)
    if step_in_backward is not None or delayed:  # None: zerokit's default ("auto": on)
        off["step_in_backward"] = bool(step_in_backward) and not delayed
    if weights_in_ram:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    else:
        param.update(max_in_cpu=0, buffer_count=ZK_PARAM_BUFFERS)
    return _merged(cfg, overrides or {})


def _merged(cfg: dict, keys: dict) -> dict:
    """`cfg` with `keys` merged in, section by section; a None value removes the key."""
    for k, v in keys.items():
        if v is None:
            cfg.pop(k, None)
        elif isinstance(v, dict) and isinstance(cfg.get(k), dict):
            _merged(cfg[k], v)
        else:
            cfg[k] = v
    return cfg


def _build(lib, cfg: dict, model: str):
    from zerokit.models import GPT

    import torch

    torch.manual_seed(1234)
    remote = cfg["zero_optimization"]["offload_param"]["device"]
    remote = "nvme" if remote == "auto" else remote  # built on NVMe, placed by initialize's plan
    # bf16 shards while building, on both sides (DeepSpeed's default with bf16 on; zerokit's
    # default keeps the fp32 values the model builds, 4 bytes per parameter until initialize)
    with lib.zero.Init(config_dict_or_path=cfg, remote_device=remote, dtype=torch.bfloat16):
        return GPT(_gpt_config(model))


def setup_deepspeed(args, rec):
    try:
        import deepspeed
    except ImportError as e:
        raise NotAvailable(f"deepspeed not installed ({e}); run `make bench-deps`") from e
    import logging

    from deepspeed.ops.op_builder import AsyncIOBuilder
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise NotAvailable("DeepSpeed's async_io op cannot build here (apt-get install libaio-dev)")
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = ds_config(args.swap, args.model, args.clipping, args.accumulation)
    rec["config"] = cfg
    model = _build(deepspeed, cfg, args.model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def zk_wrap(name: str, module) -> bool:
    """zerokit's units: each block (the default), and the embedding and the untied head each on
    their own rather than in the root unit. A unit is stepped in backward once all its gradients
    are in; the root's embedding gradient comes last, so a root holding the head too would keep
    the head's 57M elements (at 1B) out of the overlap. DeepSpeed partitions per parameter."""
    from zerokit.models.gpt import Block

    return isinstance(module, Block) or name in ("transformer.wte", "lm_head")


def setup_zerokit(args, rec):
    import zerokit

    cfg = zk_config(args.swap, args.model, args.budget_gib, args.weights_in_ram, args.delayed,
                    args.clipping, args.accumulation,
                    {None: None, "on": True, "off": False}[args.step_in_backward], args.sub_group,
                    args.bf16_state, json.loads(args.overrides) if args.overrides else None)
    rec["config"] = cfg
    try:
        model = _build(zerokit, cfg, args.model)
        engine, _, _, _ = zerokit.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                             wrap=zk_wrap)
    except (NotImplementedError, ValueError) as e:  # a refusal (e.g. nvme not built yet) is a row note
        raise NotAvailable(f"{type(e).__name__}: {str(e)[:300]}") from e
    return engine


def run_worker(args) -> int:
    import torch

    torch.set_num_threads(int(WORKER_ENV["OMP_NUM_THREADS"]))
    family = ROWS[args.worker][0]
    rec: dict = {"row": args.worker, "model": args.model, "status": "ok"}
    out = Path(args.result)

    def dump():
        # ru_maxrss follows the high-water mark that each phase resets: the run's peak is the
        # largest of the phases' peaks
        phase_peaks = [x for p in rec.get("rss_peaks_mb", []) for x in p[:3] if x]
        rec["peak_rss_mb"] = max([C.peak_rss_mb(), rec.get("setup_peak_mb") or 0] + phase_peaks)
        out.write_text(json.dumps(rec, indent=1) + "\n")

    try:
        t0 = C.now()
        engine = setup_deepspeed(args, rec) if family == "deepspeed" else setup_zerokit(args, rec)
        rec["setup_s"] = C.now() - t0
        rec["rss_after_setup_mb"] = C.current_rss_mb()
        rec["setup_peak_mb"] = C.take_rss_high_water_mb()
        block = block_stat_path(Path(args.swap))
        # setup just wrote the model's files: the steps start on a settled disk, as every row's do
        rec["settle"] = settle(lambda: write_counters(block), args.settle_quiet_s, args.settle_max_s)
        print(f"settle before the steps: {rec['settle']}", flush=True)
        g = torch.Generator().manual_seed(7)
        k = args.accumulation
        aio = getattr(getattr(engine, "nvme_tier", None), "aio", None)  # zerokit's I/O engine
        idle_clock = (lambda: aio.idle_s()[2]) if hasattr(aio, "idle_s") else (lambda: 0.0)
        toks = [[torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g) for _ in range(k)]
                for _ in range(args.warmup + args.steps)]
        steps, phases, reads, writes, losses, peaks, idles, redos = [], [], [], [], [], [], [], []
        paces, warm_redo = [], {}
        for i, micro in enumerate(toks):
            r0, w0 = _io_counters()
            dev0 = block_counters(block)
            spec0 = _speculation(engine)
            t0 = C.now()
            took = [0.0, 0.0, 0.0]  # forward, backward, step() over the step's micro-steps
            by_phase = [0.0, 0.0, 0.0]  # seconds the disk idled (nothing in flight) in each
            peak = [0, 0, 0]  # RSS peaks by phase: where the memory goes
            for t in micro:
                a, i0 = C.now(), idle_clock()
                loss = engine(t[:, :-1].contiguous(), t[:, 1:].contiguous())
                b, i1 = C.now(), idle_clock()
                peak[0] = max(peak[0], C.take_rss_high_water_mb() or 0)
                engine.backward(loss)
                c, i2 = C.now(), idle_clock()
                peak[1] = max(peak[1], C.take_rss_high_water_mb() or 0)
                engine.step()
                took = [took[0] + b - a, took[1] + c - b, took[2] + C.now() - c]
                by_phase = [x + y for x, y in zip(by_phase, (i1 - i0, i2 - i1, idle_clock() - i2))]
                peak[2] = max(peak[2], C.take_rss_high_water_mb() or 0)
                losses.append(float(loss.detach().float()))
            dt = C.now() - t0
            peaks.append(peak + [C.current_rss_mb()])
            r1, w1 = _io_counters()
            pace = disk_pace(dev0, block_counters(block))
            idle = _disk_idle(engine)
            redo = _redo(spec0, _speculation(engine))
            if i < args.warmup and redo:  # a redo there prices speculation held back after it
                warm_redo = {k: round(warm_redo.get(k, 0) + v, 3) for k, v in redo.items()}
            if i >= args.warmup:
                steps.append(dt)
                phases.append(tuple(took))
                reads.append(r1 - r0)
                writes.append(w1 - w0)
                idles.append(idle)
                redos.append(redo)
                paces.append(pace)
            print(f"step {i}: {dt:.2f} s (forward {took[0]:.2f}, backward {took[1]:.2f}, step() "
                  f"{took[2]:.2f}), read {(r1 - r0) / GiB:.2f} GiB, wrote {(w1 - w0) / GiB:.2f} GiB, "
                  f"RSS peaks MiB (forward, backward, step(), after) {[round(x or 0) for x in peaks[-1]]}"
                  + (f", disk idle {idle}, by phase {[round(x, 2) for x in by_phase]}" if idle else "")
                  + (f", device {pace['gb']:.2f} GB in {pace['busy_s']:.1f} s busy ({pace['gb_s']:.2f} GB/s)"
                     if pace else "")
                  + (f", speculation {redo}" if redo else "")
                  + (f", ledger RAM peak {counted}" if (counted := _ledger_ram_peak(engine)) else ""),
                  flush=True)
        rec.update(step_s=steps, phases_s=phases, read_bytes=reads, write_bytes=writes, losses=losses,
                   rss_peaks_mb=peaks, disk_idle=idles, speculation=redos, disk_pace=paces,  # per step
                   speculation_warmup=warm_redo or None)  # the warm-up steps' sum
        report = getattr(engine, "memory_report", None)
        if family == "zerokit" and report is not None:
            rec["memory_report"] = str(report())
        dump()
        return 0
    except NotAvailable as e:
        rec.update(status="not available", reason=str(e))
        dump()
        return 0
    except Exception as e:
        rec.update(status="error", reason=f"{type(e).__name__}: {str(e)[:400]}", traceback=traceback.format_exc())
        dump()
        raise


# ===================================================================================== parent
def disk_bandwidth(folder: Path, gib: int = 2) -> dict:
    """Sequential O_DIRECT write then read of `gib` GiB with dd (1 MiB blocks): the disk's own pace."""
    path = folder / "dd-probe"
    out = {}
    for what, cmd in (("write", ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={gib * 1024}",
                                 "oflag=direct", "conv=fsync"]),
                      ("read", ["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"])):
        t0 = C.now()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        dt = C.now() - t0
        out[f"{what}_gb_s"] = gib * GiB / dt / 1e9 if proc.returncode == 0 else None
    path.unlink(missing_ok=True)
    return out


def du_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def stalls(step_s: list[float], paces: list[dict | None], dd: dict) -> dict | None:
    """Which timed steps the disk stalled in (its pace while busy under STALL_SHARE of dd's
    slower direction, busy at least a fifth of the step), and the median of the others: the row's
    figure when the disk keeps its pace. None where the pace or dd is unknown."""
    floor = min((v for v in (dd.get("write_gb_s"), dd.get("read_gb_s")) if v), default=None)
    if not floor or not paces or any(p is None for p in paces):
        return None
    stalled = [i for i, (t, p) in enumerate(zip(step_s, paces))
               if p["gb_s"] < STALL_SHARE * floor and p["busy_s"] > 0.2 * t]
    rest = [t for i, t in enumerate(step_s) if i not in stalled]
    return {"steps": stalled, "floor_gb_s": STALL_SHARE * floor,
            "median_unstalled_s": C.summarize(rest)["median"] if rest else None}


def run_row(name: str, model: str, args, parent: Path, budget: float | None, dd: dict) -> dict:
    family, _, label = ROWS[name]
    clipping = ROW_CLIPPING.get(_base(name), args.clipping)
    res = {"row": name, "model": model, "label": label, "budget_gib": budget, "clipping": clipping,
           "accumulation": args.accumulation}
    free = shutil.disk_usage(parent).free
    need = expected_disk_bytes(model, name, args.accumulation)
    if free - need < args.min_free_gib * GiB:
        res.update(status="skipped", reason=f"needs ~{need / GiB:.1f} GiB on disk, {free / GiB:.1f} free "
                                            f"(keeping {args.min_free_gib} GiB)")
        return res
    if args.settle_max_s > 0:  # the previous row's files (or dd's) were just written and removed
        block = block_stat_path(parent)
        res["settle"] = {"row": settle(lambda: write_counters(block), args.settle_quiet_s, args.settle_max_s),
                         "steps": None}
    swap = Path(tempfile.mkdtemp(prefix=f"{name}-{model}-", dir=parent))
    result = swap.parent / f"{swap.name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--model", model,
           "--swap", str(swap), "--result", str(result), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--clipping", str(clipping),
           "--accumulation", str(args.accumulation), "--sub-group", str(args.sub_group),
           "--settle-quiet-s", str(args.settle_quiet_s), "--settle-max-s", str(args.settle_max_s)]
    cmd += ["--budget-gib", str(budget)] if budget else []
    cmd += ["--weights-in-ram"] if ROWS[name][1] == "weights" else []
    cmd += ["--delayed"] if _base(name).endswith("-dpu") else []
    sib = _steps_in_backward(name)
    cmd += ["--step-in-backward", "on" if sib else "off"] if sib is not None else []
    cmd += ["--bf16-state"] if _bf16_state(name) else []
    cmd += ["--overrides", json.dumps(args.hand_keys[name])] if name in args.hand_keys else []
    env = {**os.environ, **WORKER_ENV, "MASTER_PORT": str(29700 + len(name))}
    log = C.results_dir("logs") / f"bench_infinity-{name}-{model}.log"
    disk_peak = [0]
    t0 = C.now()
    try:
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=C.REPO_ROOT)
            while proc.poll() is None:  # the swap folder's size, sampled (files grow during init)
                disk_peak[0] = max(disk_peak[0], du_bytes(swap))
                if C.now() - t0 > args.row_timeout:
                    proc.kill()
                time.sleep(2)
        rc = proc.returncode
    finally:
        disk_peak[0] = max(disk_peak[0], du_bytes(swap) if swap.exists() else 0)
        shutil.rmtree(swap, ignore_errors=True)
    res.update(wall_s=C.now() - t0, returncode=rc, log=str(log), disk_peak_bytes=disk_peak[0])
    rec = json.loads(result.read_text()) if result.exists() else {}
    result.unlink(missing_ok=True)
    res["status"] = rec.get("status", "error")
    if "settle" in res:
        res["settle"]["steps"] = rec.get("settle")
    if res["status"] != "ok" or rc != 0:
        res["status"] = res["status"] if res["status"] != "ok" else "error"
        res["reason"] = rec.get("reason") or f"exit {rc}; see {log}"
        return res
    step = C.summarize(rec["step_s"])
    res.update(step_s=step, peak_rss_mb=rec["peak_rss_mb"], setup_s=rec["setup_s"], losses=rec["losses"],
               read_bytes_per_step=C.summarize(rec["read_bytes"])["median"],
               write_bytes_per_step=C.summarize(rec["write_bytes"])["median"],
               tokens_per_s=MICRO * SEQ * args.accumulation / step["median"],
               memory_report=rec.get("memory_report"), disk_idle=_median_of(rec.get("disk_idle")),
               speculation=_median_of(rec.get("speculation")),
               speculation_warmup=rec.get("speculation_warmup"),
               phases_s=rec.get("phases_s"), setup_peak_mb=rec.get("setup_peak_mb"),
               rss_peaks_mb=rec.get("rss_peaks_mb"), disk_pace=rec.get("disk_pace"),
               stalls=stalls(rec["step_s"], rec.get("disk_pace"), dd))
    res["io_gb_s"] = (res["read_bytes_per_step"] + res["write_bytes_per_step"]) / step["median"] / 1e9
    return res


def merge_rounds(runs: list[dict]) -> dict:
    """One row's result over --rounds runs: the last run's record with its s/step the median of
    the runs' medians (min / max over all their steps), the per-step I/O and tokens/s from those,
    peak RSS and disk the largest of any run; each run's median in "step_s_rounds". A run that
    failed makes the row's result that run's (a row that fails once is not reported as good)."""
    import statistics

    bad = [r for r in runs if r["status"] != "ok"]
    if bad:
        return dict(bad[0], rounds_ok=len(runs) - len(bad), rounds=len(runs))
    res = dict(runs[-1])
    medians = [r["step_s"]["median"] for r in runs]
    res["step_s"] = dict(res["step_s"], median=statistics.median(medians),
                         min=min(r["step_s"]["min"] for r in runs), max=max(r["step_s"]["max"] for r in runs))
    res["step_s_rounds"] = medians
    for key in ("read_bytes_per_step", "write_bytes_per_step"):
        res[key] = statistics.median(r[key] for r in runs)
    for key in ("peak_rss_mb", "disk_peak_bytes"):
        res[key] = max(r[key] for r in runs)
    step = res["step_s"]["median"]
    res["tokens_per_s"] = runs[-1]["tokens_per_s"] * runs[-1]["step_s"]["median"] / step
    res["io_gb_s"] = (res["read_bytes_per_step"] + res["write_bytes_per_step"]) / step / 1e9
    return res


def round_order(rows: list[str], k: int) -> list[str]:
    """Round k's order: --rows as given in even rounds, reversed in odd ones; ds-inf stays first
    where it is first (the budgeted rows after it are sized by its RSS in round 0)."""
    if k % 2 == 0:
        return list(rows)
    head = [r for r in rows[:1] if r == "ds-inf"]
    return head + [r for r in reversed(rows) if r not in head]


def _rounds_cell(r: dict) -> str:
    """Each round's s/step, in run order ("" for a single round)."""
    runs = r.get("step_s_rounds") or []
    return "/".join(f"{m:.2f}" for m in runs) if len(runs) > 1 else ""


def _median_of(per_step: list | None) -> dict | None:
    """Per key, the median over the timed steps of dicts (None where a step had none)."""
    if not per_step or any(d is None for d in per_step):
        return None
    return {k: C.summarize([d[k] for d in per_step])["median"] for k in per_step[0]}


def _idle_cell(r: dict) -> str:
    """Seconds per step the disk had nothing in flight, and (no read / no write) apart."""
    d = r.get("disk_idle")
    if not d:
        return "n/a"
    return f"{d['idle_s']:.1f} ({d['read_idle_s']:.1f}/{d['write_idle_s']:.1f})"


def _redo_cell(r: dict) -> str:
    """The speculative step's redo per timed step: seconds, and redone of committed + redone;
    then the warm-up steps' where they speculated (adaptive speculation redoes the first step
    whose clipping applies and holds the later ones back, so the timed steps show no redo)."""
    d = r.get("speculation")
    if not d:
        return "n/a"
    cell = f"{d['redo_s']:.2f} s, {d['redone']:.0f}/{d['committed'] + d['redone']:.0f} redone"
    w = r.get("speculation_warmup")
    if w and w["committed"] + w["redone"]:
        cell += f" (warm-up: {w['redo_s']:.2f} s, {w['redone']:.0f}/{w['committed'] + w['redone']:.0f})"
    return cell


def busy_pace(r: dict) -> float | None:
    """The median over the timed steps of the disk's pace while busy (GB/s, reads and writes
    together): the device's state during the row, to read a row's time against its peer's (the
    disk's pace swings several-fold within the hour; docs/nvme.md)."""
    paces = [p["gb_s"] for p in r.get("disk_pace") or [] if p]
    return C.summarize(paces)["median"] if paces else None


def _note(r: dict) -> str:
    """The budget, and the RSS peak of setup and of the timed steps apart (which one set the run's)."""
    parts = [f"budget {r['budget_gib']:.1f} GiB"] if r["budget_gib"] else []
    parts += ["bf16 master + states"] if _bf16_state(r["row"]) else []
    parts.append(f"clip {r['clipping']:g}" + (f", accum {r['accumulation']}" if r["accumulation"] > 1 else ""))
    peaks = [max(x or 0 for x in p[:3]) for p in (r.get("rss_peaks_mb") or [])]
    if r.get("setup_peak_mb") and peaks:
        parts.append(f"peak setup {r['setup_peak_mb'] / 1024:.2f}, steps {max(peaks) / 1024:.2f} GiB")
    st = r.get("stalls")
    if st and st["steps"]:
        rest = st["median_unstalled_s"]
        parts.append(f"disk stalled in {len(st['steps'])} of {len(r['disk_pace'])} steps (< "
                     f"{st['floor_gb_s']:.2f} GB/s busy)" + (f", the others {rest:.2f} s" if rest else ""))
    parts += [note] if (note := _settle_note(r.get("settle"))) else []
    return "; ".join(parts)


def _settle_note(s: dict | None) -> str | None:
    """How long the disk took to settle before the row and before its timed steps; None when
    settling was off (--settle-max-s 0)."""
    if s is None:
        return None
    waits = [(when, w) for when, w in (("before the row", s["row"]), ("before the steps", s["steps"])) if w]
    if not waits:
        return "disk not settled: no block device under the swap folder"
    return "disk " + ", ".join(("settled" if w["settled"] else "still busy after")
                               + f" {w['waited_s']:.0f} s {when}" for when, w in waits)


def report(results: list[dict]) -> str:
    headers = ["model", "row", "s/step", "rounds", "tokens/s", "vs DS", "peak RSS GiB", "disk GB", "read GB/step",
               "write GB/step", "I/O GB/s", "busy disk GB/s", "disk idle s (no read/no write)", "redo",
               "note"]
    ds = {r["model"]: r for r in results if r["row"] == "ds-inf" and r["status"] == "ok"}
    rows = []
    for r in results:
        if r["status"] != "ok":
            rows.append([r["model"], r["row"]] + [""] * 12 + [f"{r['status']}: {r.get('reason', '')}"[:100]])
            continue
        peer = ds.get(r["model"])
        rows.append([r["model"], r["row"], C.fmt_num(r["step_s"]["median"], ".2f"), _rounds_cell(r),
                     C.fmt_num(r["tokens_per_s"], ".1f"),
                     C.fmt_num(C.ratio(r["tokens_per_s"], peer["tokens_per_s"]) if peer else None, ".2f", "x"),
                     C.fmt_num(r["peak_rss_mb"] / 1024, ".2f"), C.fmt_num(r["disk_peak_bytes"] / 1e9, ".1f"),
                     C.fmt_num(r["read_bytes_per_step"] / 1e9, ".2f"), C.fmt_num(r["write_bytes_per_step"] / 1e9, ".2f"),
                     C.fmt_num(r["io_gb_s"], ".2f"), C.fmt_num(busy_pace(r), ".2f"), _idle_cell(r),
                     _redo_cell(r), _note(r)])
    return C.format_table(headers, rows)


def planner_report(results: list[dict]) -> str | None:
    """Each budgeted row beside the fastest hand row (--hand) of the same model whose peak RSS
    fits that budget: issue #28 asks the planner's choice to be within 10% of it."""
    ok = [r for r in results if r["status"] == "ok"]
    rows = []
    for r in ok:
        if not r.get("budget_gib") or r["row"].startswith(HAND):
            continue
        fits = [h for h in ok if h["row"].startswith(HAND) and h["model"] == r["model"]
                and _bf16_state(h["row"]) == _bf16_state(r["row"])
                and h["peak_rss_mb"] / 1024 <= r["budget_gib"]]
        best = min(fits, key=lambda h: h["step_s"]["median"]) if fits else None
        ratio = C.ratio(r["step_s"]["median"], best["step_s"]["median"]) if best else None
        rows.append([r["model"], r["row"], f"{r['budget_gib']:.2f}", C.fmt_num(r["peak_rss_mb"] / 1024, ".2f"),
                     "yes" if r["peak_rss_mb"] / 1024 <= r["budget_gib"] else "NO",
                     C.fmt_num(r["step_s"]["median"], ".2f"), best["row"] if best else "none fits",
                     C.fmt_num(best["step_s"]["median"], ".2f") if best else "",
                     C.fmt_num(best["peak_rss_mb"] / 1024, ".2f") if best else "",
                     C.fmt_num(ratio, ".2f", "x"),
                     ("yes" if ratio <= 1.10 else "NO") if ratio is not None else ""])
    if not rows:
        return None
    return C.format_table(["model", "budgeted row", "budget GiB", "peak RSS GiB", "RSS <= budget", "s/step",
                           "best hand row in budget", "its s/step", "its RSS GiB", "budget / hand",
                           "within 10%"], rows)


def bf16_report(results: list[dict]) -> str | None:
    """Each -bf16 row beside its fp32-state twin of the same model (same placement keys and
    budget): bytes read and written per step, disk, step time, and bf16 / fp32 for each."""
    ok = {(r["model"], r["row"]): r for r in results if r["status"] == "ok"}
    rows = []
    for (model, name), r in ok.items():
        base = ok.get((model, _base(name))) if _bf16_state(name) else None
        if base is None:
            continue
        cells = [model, name, _base(name)]
        for key, scale in (("read_bytes_per_step", 1e9), ("write_bytes_per_step", 1e9), ("disk_peak_bytes", 1e9)):
            cells += [f"{r[key] / scale:.2f} / {base[key] / scale:.2f}", C.fmt_num(C.ratio(r[key], base[key]), ".2f", "x")]
        cells += [f"{r['step_s']['median']:.2f} / {base['step_s']['median']:.2f}",
                  C.fmt_num(C.ratio(r["step_s"]["median"], base["step_s"]["median"]), ".2f", "x")]
        rows.append(cells)
    if not rows:
        return None
    return C.format_table(["model", "bf16 row", "fp32 row", "read GB/step", "ratio", "write GB/step", "ratio",
                           "disk GB", "ratio", "s/step", "ratio"], rows)


def row_list(args) -> list[str]:
    """The rows to run, in order: --rows, then the --hand rows; each once (a hand row named in
    --rows too runs where --rows puts it)."""
    return list(dict.fromkeys([r for r in args.rows.split(",") if r] + list(args.hand_keys)))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    models = [m for m in args.models.split(",") if m]
    rows = row_list(args)
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"--models: unknown {m!r}; choose from {', '.join(MODELS)}")
    for r in rows:
        if r not in ROWS:
            raise SystemExit(f"--rows: unknown {r!r}; choose from {', '.join(ROWS)}")
    # results_dir() creates benchmarks/results: mkdtemp does not create its parent (a fresh clone)
    parent = Path(args.nvme_dir or tempfile.mkdtemp(prefix="zk-bench-infinity-", dir=C.results_dir()))
    parent.mkdir(parents=True, exist_ok=True)
    machine = C.machine_info()
    print(f"bench_infinity: models {models}, rows {rows}; stage 3, params + optimizer on NVMe, bf16, AdamW, "
          f"seq {SEQ}, micro-batch {MICRO}, 1 rank x {WORKER_ENV['OMP_NUM_THREADS']} threads, gradient_clipping "
          f"{args.clipping:g}, accumulation {args.accumulation}; swap under {parent}",
          flush=True)
    disk = disk_bandwidth(parent)
    print(f"disk (dd, O_DIRECT, 1 MiB blocks): write {disk['write_gb_s']:.2f} GB/s, read {disk['read_gb_s']:.2f} GB/s",
          flush=True)
    results: list[dict] = []
    for model in models:
        ds_rss = args.ds_rss_gib
        runs: dict[str, list[dict]] = {name: [] for name in rows}
        for k in range(args.rounds):
            for name in round_order(rows, k):
                budget = ROWS[name][1]
                if budget == "weights":
                    budget = None
                elif budget in ("ds", "half"):
                    budget = (ds_rss / (2 if budget == "half" else 1)) if ds_rss else None
                    if budget is None:
                        runs[name].append({"row": name, "model": model, "status": "skipped",
                                           "reason": "no DeepSpeed RSS to budget by (run ds-inf first or --ds-rss-gib)"})
                        continue
                r = run_row(name, model, args, parent, budget, disk)
                if name == "ds-inf" and r["status"] == "ok" and k == 0:
                    ds_rss = r["peak_rss_mb"] / 1024  # round 0's: every round's budgets are the same
                runs[name].append(r)
                msg = (f"{r['step_s']['median']:.2f} s/step, peak RSS {r['peak_rss_mb'] / 1024:.2f} GiB"
                       if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}")
                lap = f" (round {k + 1}/{args.rounds})" if args.rounds > 1 else ""
                print(f"  {model:5s} {name:12s} {msg}{lap}", flush=True)
        results += [merge_rounds(runs[name]) for name in rows]
    shutil.rmtree(parent, ignore_errors=True) if args.nvme_dir is None else None
    table = report(results)
    print()
    print(table)
    planner_table = planner_report(results)
    if planner_table:
        print("\nthe planner's choice (budgeted rows) vs the fastest hand-tuned row in the same budget:")
        print(planner_table)
    bf16_table = bf16_report(results)
    if bf16_table:
        print("\nbf16 master + states vs fp32 states, same placement keys and budget (bf16 / fp32):")
        print(bf16_table)
    path = C.write_json("bench_infinity", {"benchmark": "bench_infinity", "argv": sys.argv[1:],
                                           "setup": {"vocab": VOCAB, "seq": SEQ, "micro_batch": MICRO,
                                                     "gradient_clipping": args.clipping,
                                                     "accumulation": args.accumulation,
                                                     "rounds": args.rounds,
                                                     "models": {m: {"shape": MODELS[m], "params": n_params(m)} for m in models},
                                                     "worker_env": WORKER_ENV, "adamw": ADAMW},
                                           "disk": disk, "machine": machine, "rows": results, "table": table,
                                           "bf16_table": bf16_table, "planner_table": planner_table,
                                           "hand": args.hand_keys}, args.out)
    print(f"\nwrote {path}")
    return 0 if all(r["status"] != "error" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
