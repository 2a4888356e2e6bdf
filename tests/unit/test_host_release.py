"""release_free_host_memory gives the heap's freed pages back: RSS measured, in a fresh process."""
from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

# A fresh interpreter, so the heap holds only what the script makes: free a 16 MiB mapped block
# (glibc then serves blocks up to that size from the heap; 32 MiB would not raise its threshold),
# fill 600 MiB of 4 MiB tensors with a small live tensor after each (the heap's top is never
# free, so free() keeps the pages), free them, then release. zerokit is imported after: with its
# optimizer package loaded first, free() already gave these blocks back here (seen, cause not
# pinned down); the engine's own process kept 2.1 GiB (see zerokit/tiers/host_release.py).
HEAP_GARBAGE = r"""
x = torch.ones(4 << 20)
del x
keep, big = [], []
for _ in range(150):
    big.append(torch.ones(1 << 20))
    keep.append(torch.ones(16))
"""
SCRIPT = r"""
import json, psutil, torch
rss = lambda: psutil.Process().memory_info().rss
""" + HEAP_GARBAGE + r"""
filled = rss()
del big
freed = rss()
from zerokit.tiers.host_release import release_free_host_memory  # after: zerokit's imports load
released = release_free_host_memory("test")
print(json.dumps({"filled": filled, "freed": freed, "after": rss(), "released": released}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_heap_pages_go_back_to_the_os() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2 ** 20
    # the premise: free() alone kept (nearly) all of it resident
    assert m["filled"] - m["freed"] < 100 * mib, m
    assert m["freed"] - m["after"] > 500 * mib, m
    assert abs(m["released"] - (m["freed"] - m["after"])) < 50 * mib, m


# The heap garbage of the script above, then initialize: its layout (16-bit weights, fp32
# master, gradients and Adam state of a 25M-parameter model: ~670 MiB) must not stack on the
# garbage, which initialize hands back before the layout allocates. The peak is the kernel's
# (VmHWM, reset just before initialize).
INIT_SCRIPT = r"""
import json, psutil, torch
rss = lambda: psutil.Process().memory_info().rss
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)])
""" + HEAP_GARBAGE + r"""
del big
import zerokit
torch.set_num_threads(1)
freed = rss()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
engine, *_ = zerokit.initialize(model=model, config={
    "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
with open("/proc/self/status") as f:
    peak = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
print(json.dumps({"freed": freed, "peak": peak, "after": rss(),
                  "host": engine.ledger.held("host"), "device": engine.ledger.held("device")}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_initialize_hands_the_heaps_garbage_back_before_the_layout_allocates() -> None:
    out = subprocess.run([sys.executable, "-c", INIT_SCRIPT], capture_output=True, text=True, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2 ** 20
    laid_out = m["host"] + m["device"]
    assert laid_out > 300 * mib, m  # the premise: the layout allocates a garbage's worth
    # the garbage was resident, then handed back: the layout came on top of less than it
    assert m["freed"] + laid_out - m["after"] > 300 * mib, {k: v / mib for k, v in m.items()}
    # stacked, the peak would be the garbage plus the layout; handed back first, about the larger
    assert m["peak"] - m["freed"] < 0.5 * laid_out, {k: v / mib for k, v in m.items()}


# A model built under zero.Init with its weights on NVMe: initialize gathers each construction
# unit's weights (pieces under glibc's mmap threshold, so into the heap) to lay them out, then
# retires them. Handed back unit by unit, that garbage never stacks up under the layout: setup's
# peak is the laid-out engine's RSS. Without it the peak was one model's bf16 weights above.
ZERO_INIT_SCRIPT = r"""
import json, psutil, tempfile, torch
import zerokit
rss = lambda: psutil.Process().memory_info().rss
torch.set_num_threads(1)
x = torch.ones(8 << 20); del x  # 32 MiB freed: glibc serves blocks below that from the heap
d = tempfile.mkdtemp()  # the construction's weight files (removed as initialize lays them out)
cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "bf16": {"enabled": True},
       "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": d},
                             "offload_optimizer": {"device": "nvme", "nvme_path": d}}}
with zerokit.zero.Init(config_dict_or_path=cfg, remote_device="nvme", dtype=torch.bfloat16):
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 2048) for _ in range(32)])
weights = sum(p.ds_numel for p in model.parameters()) * 2
cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
engine, *_ = zerokit.initialize(model=model, config=cfg)
with open("/proc/self/status") as f:
    peak = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
print(json.dumps({"peak": peak, "after": rss(), "weights": weights}))
engine.destroy()
import shutil; shutil.rmtree(d, ignore_errors=True)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_initialize_hands_zero_inits_gathered_weights_back_unit_by_unit() -> None:
    out = subprocess.run([sys.executable, "-c", ZERO_INIT_SCRIPT], capture_output=True, text=True,
                         check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2 ** 20
    assert m["weights"] > 100 * mib, m
    assert m["peak"] - m["after"] < 0.25 * m["weights"], {k: v / mib for k, v in m.items()}
