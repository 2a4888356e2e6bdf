"""Refusing an NVMe plan the swap directory cannot hold, at start-up, with the numbers and the path.

With offload_optimizer device 'nvme' each rank keeps the fp32 master, gradient and optimizer state of its
nvme parts in files under `nvme_path` (tiers/nvme.py). Before anything is allocated
`check_nvme_path` checks that the path exists, is a directory, can be written, and has room for
what every rank on this machine will reserve; each failure names the path and the numbers.
`nvme_need` is the bytes this rank reserves, `step_traffic` what one step reads and writes.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile

from zerokit.engine.host_budget import local_ranks, size
from zerokit.config.plan import STATE_BYTES_PER_ELEMENT


class NvmePathError(OSError):
    """offload_optimizer.nvme_path cannot hold the plan."""


def nvme_need(layouts: list, optimizer_kind: str | None) -> int:
    """Bytes this rank's nvme parts reserve: the fp32 master and gradient records plus the
    optimizer state, allocated at bind (an optimizer of unknown kind counted as Adam)."""
    state = STATE_BYTES_PER_ELEMENT.get(optimizer_kind or "", 8)
    return sum(layout.bytes("nvme").get("master", 0) + layout.bytes("nvme").get("grads", 0)
               + state * layout.nvme_numel for layout in layouts)


def step_traffic(layouts: list, optimizer_kind: str | None) -> int:
    """NVMe bytes one step moves on this rank: every nvme element's master, gradient and state
    written once and read once."""
    return 2 * nvme_need(layouts, optimizer_kind)


def check_nvme_path(path: str, need: int, ranks: int | None = None,
                    free: int | None = None) -> None:
    """Raises NvmePathError when `ranks` ranks each reserving `need` bytes cannot use `path`."""
    key = "zero_optimization.offload_optimizer.nvme_path"
    if not os.path.exists(path):
        raise NvmePathError(errno.ENOENT, f"{key} {path!r} does not exist; create the directory "
                                          f"(on the NVMe drive) first")
    if not os.path.isdir(path):
        raise NvmePathError(errno.ENOTDIR, f"{key} {path!r} is not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".zerokit-probe-"):
            pass
    except OSError as e:
        raise NvmePathError(e.errno or errno.EACCES,
                            f"{key} {path!r} is not writable ({os.strerror(e.errno or errno.EACCES)})"
                            ) from None
    ranks = local_ranks() if ranks is None else ranks
    free = shutil.disk_usage(path).free if free is None else free
    if need * ranks > free:
        raise NvmePathError(errno.ENOSPC,
                            f"{key} {path!r} has {size(free)} free, but the plan reserves "
                            f"{size(need)} per rank (fp32 master, gradient and optimizer state on NVMe) x "
                            f"{ranks} rank(s) on this machine = {size(need * ranks)}; free space, "
                            f"choose another path, or keep more in host memory "
                            f"(offload_optimizer.max_in_cpu)")
