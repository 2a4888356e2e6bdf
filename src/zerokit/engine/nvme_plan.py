"""Refusing an NVMe plan the swap directory cannot hold, at start-up, with the numbers and the path.

With offload_optimizer device 'nvme' each rank keeps the master, gradient and optimizer state of its
nvme parts in files under `nvme_path` (tiers/nvme.py): fp32, or bf16 with
bf16.bf16_master_weights_and_grads / bf16_optimizer_states (half the bytes). Before anything is allocated
`check_nvme_path` checks that the path exists, is a directory, can be written, and has room for
what every rank on this machine will reserve; each failure names the path and the numbers.
`nvme_need` is the bytes this rank reserves (one step reads and writes each once, and the
gradient files again per accumulating micro-step: policy/layout.py `gradient_refill_bytes`).
With offload_param device 'nvme' the stage-3 weight shards are files too (`weight_need`,
`weight_traffic`), checked against offload_param.nvme_path.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile

import torch

from zerokit.engine.host_budget import local_ranks, size, state_bytes_per_element
from zerokit.tier_names import TierName


class NvmePathError(OSError):
    """offload_optimizer.nvme_path cannot hold the plan."""


def nvme_need(layouts: list, optimizer_kind: str | None,
              state_dtype: torch.dtype = torch.float32) -> int:
    """Bytes this rank's nvme parts reserve: the master and gradient records (in the records'
    dtype) plus the optimizer state, allocated at bind in `state_dtype` (an optimizer of unknown
    kind counted as Adam)."""
    state = state_bytes_per_element(optimizer_kind, state_dtype)
    on_nvme = [layout.bytes(TierName.NVME) for layout in layouts]
    return sum(files.get("master", 0) + files.get("grads", 0) + state * layout.nvme_numel
               for files, layout in zip(on_nvme, layouts))


def weight_need(layouts: list) -> int:
    """Bytes this rank's weight shard files reserve (offload_param device 'nvme')."""
    return sum(layout.bytes(TierName.NVME).get("weights", 0) for layout in layouts)


def weight_traffic(layouts: list, micro_steps: int) -> tuple[int, int]:
    """(bytes read, bytes written) per step for the weight shard files: each shard read once
    per gather, a forward and a backward one per micro-step, and written once after the step."""
    need = weight_need(layouts)
    return 2 * micro_steps * need, need


def check_nvme_path(path: str, need: int, ranks: int | None = None,
                    free: int | None = None, *, section: str = "offload_optimizer",
                    what: str = "master, gradient and optimizer state on NVMe") -> None:
    """Raises NvmePathError when `ranks` ranks each reserving `need` bytes cannot use `path`
    (`section`'s nvme_path, holding `what`)."""
    key = f"zero_optimization.{section}.nvme_path"
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
                            f"{size(need)} per rank ({what}) x "
                            f"{ranks} rank(s) on this machine = {size(need * ranks)}; free space, "
                            f"choose another path, or keep more in host memory "
                            f"({section}.max_in_cpu)")
