#!/usr/bin/env python
"""Checkpoint save / load time and throughput: zerokit sync and async vs DeepSpeed vs DCP + FSDP2.

    flock /tmp/zk-heavy.lock .venv/bin/python benchmarks/bench_checkpoint.py
    python benchmarks/bench_checkpoint.py --only zk-sync,zk-async --layers 2      # quick

Each row is its own `torchrun --standalone --nproc-per-node 2` job (gloo ranks on this CPU) that
builds the demo GPT (default 7 layers, width 1024: ~88M parameters, ~1.06 GB of fp32 weights +
AdamW state), takes one training step so the optimizer state exists, then saves and loads
`--repeats` times. A time is the slowest rank's, between barriers. Throughput = bytes of the
checkpoint directory / time. After each save the checkpoint's files are dropped from the page cache
(posix_fadvise DONTNEED on fsynced files), so loads read from the disk, for every row alike.
The disk's sequential bandwidth is measured in the same run with dd (1 GiB, conv=fdatasync; read
after dropping it from the cache), buffered and with O_DIRECT; "of disk" is against the faster.
Rows: zk-sync, zk-async (zerokit stage 2; for async the
training stall is the time save_checkpoint takes to return plus how much longer than a normal
step the next training step takes (it waits there if the writer still reads the state it
changes, and shares the cores with the writer); its save s is the time until the commit,
with that training step running meanwhile),
ds (DeepSpeed ZeRO-2, CPU accelerator, save_checkpoint/load_checkpoint), dcp (torch FSDP2
fully_shard + torch.distributed.checkpoint save/load of model and optimizer state dicts).
Results: a table, and JSON in benchmarks/results/bench_checkpoint-<time>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

ROWS = {"zk-sync": "zerokit stage 2, sync", "zk-async": "zerokit stage 2, async",
        "ds": "DeepSpeed ZeRO-2", "dcp": "torch DCP + FSDP2"}
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
ADAMW = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(ROWS), help=f"rows: {', '.join(ROWS)}")
    p.add_argument("--layers", type=int, default=7)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir in /tmp)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ===================================================================================== worker
def _drop_cache(path: str) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _model(args):
    import torch
    from zerokit.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=8, block_size=64, vocab_size=256))


def run_worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    rec = {"row": args.worker, "rank": rank, "save_s": [], "load_s": [], "stall_s": []}
    x = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(rank))
    root = args.dir
    if args.worker.startswith("zk"):
        import zerokit
        from zerokit.checkpoint import wait_for_checkpoint

        cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": ADAMW},
               "zero_optimization": {"stage": 2},
               "checkpoint": {"async_save": args.worker == "zk-async"}}
        engine, _, _, _ = zerokit.initialize(model=_model(args), config=cfg)

        def train_step() -> float:
            t = C.now()
            engine.backward(engine(x, x))
            engine.step()
            return C.now() - t
        step_s = sorted(train_step() for _ in range(3))[1]  # median of 3: a step with no save

        def save(tag):
            engine.save_checkpoint(root, tag=tag)
            if args.worker == "zk-async":
                # The stall is what training loses: the call, plus what the next step took beyond
                # a normal step (it waits there if the writer still reads the state, and the
                # writer competes with it for the cores).
                returned = C.now() - t0
                rec["stall_s"].append(returned + max(0.0, train_step() - step_s))
                rec.setdefault("step_s", step_s)
            wait_for_checkpoint(engine)

        def load(tag):
            engine.load_checkpoint(root, tag=tag)
    elif args.worker == "ds":
        import logging

        import deepspeed
        from deepspeed.utils import logger

        logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")
        model = _model(args)
        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
               "optimizer": {"type": "AdamW", "params": {**ADAMW, "torch_adam": True}},
               "zero_optimization": {"stage": 2}, "steps_per_print": 10**9}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        engine.backward(engine(x, x))
        engine.step()

        def save(tag):
            engine.save_checkpoint(root, tag=tag)

        def load(tag):
            engine.load_checkpoint(root, tag=tag)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = _model(args)
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        model(x, x).backward()
        opt.step()

        def save(tag):
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, tag))

        def load(tag):
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=os.path.join(root, tag))
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for i in range(args.repeats):
        tag = f"bench{i}"
        dist.barrier()
        t0 = C.now()
        save(tag)
        dist.barrier()
        rec["save_s"].append(C.now() - t0)
        if rank == 0:
            _drop_cache(os.path.join(root, tag))
            rec["bytes"] = _dir_bytes(os.path.join(root, tag))
        dist.barrier()
        t0 = C.now()
        load(tag)
        dist.barrier()
        rec["load_s"].append(C.now() - t0)
    rec["peak_rss_mb"] = C.peak_rss_mb()
    Path(args.result).with_name(f"rank{rank}.json").write_text(json.dumps(rec))


# ===================================================================================== parent
def dd_bandwidth(directory: str) -> dict:
    """Sequential bandwidth of the checkpoint directory's disk, 1 GiB with dd, through the page
    cache and with O_DIRECT (zerokit writes its shard files with O_DIRECT, so buffered dd alone
    would flatter it); the targets are set against the faster of the two, per direction."""
    path = os.path.join(directory, "dd.bin")

    def rate(cmd):
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", out)
        return int(m.group(1)) / float(m.group(2)) / 1e9
    res = {}
    for mode, oflag, iflag in (("buffered", [], []), ("direct", ["oflag=direct"], ["iflag=direct"])):
        res[f"write_{mode}_GBps"] = rate(["dd", "if=/dev/zero", f"of={path}", "bs=16M", "count=64",
                                          "conv=fdatasync", *oflag])
        _drop_cache(directory)
        res[f"read_{mode}_GBps"] = rate(["dd", f"if={path}", "of=/dev/null", "bs=16M", *iflag])
        os.remove(path)
    res["write_GBps"] = max(res["write_buffered_GBps"], res["write_direct_GBps"])
    res["read_GBps"] = max(res["read_buffered_GBps"], res["read_direct_GBps"])
    return res


def run_row(name: str, args, root: str) -> dict:
    ckpt = os.path.join(root, name)
    os.makedirs(ckpt)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               __file__, "--worker", name, "--result", os.path.join(tmp, "r.json"), "--dir", ckpt,
               "--layers", str(args.layers), "--width", str(args.width), "--repeats", str(args.repeats)]
        proc = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True, cwd=C.REPO_ROOT)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    shutil.rmtree(ckpt, ignore_errors=True)
    if proc.returncode != 0 or len(ranks) != 2:
        return {"row": name, "status": "error", "log_tail": (proc.stdout + proc.stderr).splitlines()[-15:]}
    res = {"row": name, "status": "ok", "bytes": ranks[0]["bytes"]}
    for key in ("save_s", "load_s", "stall_s"):
        if ranks[0][key]:
            res[key + "_per_save"] = C.elementwise_max([r[key] for r in ranks])
            res[key] = C.summarize(res[key + "_per_save"])
    res["peak_rss_mb"] = max(r["peak_rss_mb"] for r in ranks)
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        try:
            run_worker(args)
        except Exception:
            traceback.print_exc()
            return 1
        return 0
    root = args.dir or tempfile.mkdtemp(prefix="zk-bench-ckpt-")
    disk = dd_bandwidth(root)
    print(f"disk (dd, 1 GiB, best of buffered / O_DIRECT): write {disk['write_GBps']:.2f} GB/s "
          f"({disk['write_buffered_GBps']:.2f} / {disk['write_direct_GBps']:.2f}), read {disk['read_GBps']:.2f} GB/s "
          f"({disk['read_buffered_GBps']:.2f} / {disk['read_direct_GBps']:.2f})", flush=True)
    results = []
    for name in args.only.split(","):
        res = run_row(name, args, root)
        results.append(res)
        print(name, res.get("status"), "" if res["status"] == "ok" else "\n".join(res["log_tail"]), flush=True)
    shutil.rmtree(root, ignore_errors=True) if args.dir is None else None
    rows = []
    for r in results:
        if r["status"] != "ok":
            rows.append([r["row"], "error"] + [""] * 9)
            continue
        gb = r["bytes"] / 1e9
        save, load = r["save_s"]["median"], r["load_s"]["median"]
        stalls = r.get("stall_s_per_save", []) if r["row"] == "zk-async" else []
        first = stalls[0] if stalls else None
        steady = C.summarize(stalls[1:])["median"] if len(stalls) > 1 else None
        rows.append([ROWS[r["row"]], f"{gb:.2f}", f"{save:.2f}", f"{gb / save:.2f}",
                     f"{100 * gb / save / disk['write_GBps']:.0f}%", f"{load:.2f}", f"{gb / load:.2f}",
                     f"{100 * gb / load / disk['read_GBps']:.0f}%", C.fmt_num(first, ".3f"),
                     C.fmt_num(steady, ".3f"), f"{r['peak_rss_mb']:.0f}"])
    print(C.format_table(["row", "GB", "save s", "save GB/s", "of disk", "load s", "load GB/s", "of disk",
                          "stall 1st s", "stall later s", "peak RSS MB"], rows))
    by_row = {r["row"]: r for r in results if r["status"] == "ok"}
    if "zk-sync" in by_row and "zk-async" in by_row:
        stall = max(by_row["zk-async"]["stall_s_per_save"])
        sync = by_row["zk-sync"]["save_s"]["median"]
        print(f"async stall, worst save: {stall:.3f} s = {100 * stall / sync:.0f}% of the sync save "
              f"({sync:.2f} s)")
    path = C.write_json("bench_checkpoint", {"machine": C.machine_info(), "disk": disk, "args": vars(args),
                                             "results": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
