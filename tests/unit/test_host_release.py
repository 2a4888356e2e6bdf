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
SCRIPT = r"""
import json, psutil, torch
rss = lambda: psutil.Process().memory_info().rss
x = torch.ones(4 << 20)
del x
keep, big = [], []
for _ in range(150):
    big.append(torch.ones(1 << 20))
    keep.append(torch.ones(16))
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
