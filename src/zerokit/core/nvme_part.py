"""The nvme part of a unit's optimizer range: master and optimizer state in files.

See [Note: optimizer parts] in core/parts.py. An `NvmePart` is a HostPart whose fp32 master and
optimizer state are `FileRange`s on the nvme tier (tiers/nvme.py) instead of host tensors; its
gradient and its new compute-dtype weights (`out16`, whatever the dtype) stay in host memory, so
gradient arrival, the norm, clearing and the write-back of the weights are the host part's. The
streaming executor (engine/nvme_executor.py) steps it a sub-group at a time; the few operations
that need the whole master (an edit under GatheredParameters, `full_master`) read it whole, one
part at a time.
"""
from __future__ import annotations

import torch

from zerokit.core.layout import OptimizerPart
from zerokit.core.parts import STATE_NAMES, HostPart
from zerokit.io.buffers import aligned_empty
from zerokit.tiers.nvme import FileRange, NvmeTier
from zerokit.tiers.tier import Tier


def host_buffer(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A host tensor at a 4096-aligned address: a file range at offset 0 moves by O_DIRECT."""
    return aligned_empty(numel * torch.empty(0, dtype=dtype).element_size()).view(dtype)


def read_range(nvme: NvmeTier, rng: FileRange) -> torch.Tensor:
    out = host_buffer(rng.numel, rng.dtype)
    nvme.read(rng, out).wait()
    return out


def fill_range(nvme: NvmeTier, rng: FileRange, values: torch.Tensor | float) -> None:
    """The file range <- values (a tensor of its length, or one number)."""
    buf = host_buffer(rng.numel, rng.dtype)
    if isinstance(values, torch.Tensor):
        buf.copy_(values)
    else:
        buf.fill_(values)
    nvme.write(rng, buf).wait()


class NvmePart(HostPart):
    tier = "nvme"

    def __init__(self, unit, span: OptimizerPart, buffers: dict, host: Tier, nvme: NvmeTier,
                 home: torch.Tensor, pinned: bool):
        names = {"host_master": "nvme_master", "host_grad0": "nvme_grad0",
                 "host_out16": "nvme_out", "host_staging": "nvme_staging"}
        super().__init__(unit, span, {k: buffers[v] for k, v in names.items() if v in buffers},
                         host, home, in_place=False, pinned=pinned)
        self.nvme = nvme
        self.master: FileRange

    def init_state(self, family: str, fill: float = 0.0) -> None:
        """The optimizer state files (zero-filled when reserved: DeepSpeed's fast_init)."""
        if self.state:
            return
        for key in STATE_NAMES[family]:
            self.state[key] = self.nvme.allocate(f"{self.unit.name}/nvme_state.{key}",
                                                 "optimizer_state", self.numel, torch.float32)
            if fill:
                fill_range(self.nvme, self.state[key], fill)

    def master_values(self) -> torch.Tensor:
        return read_range(self.nvme, self.master)

    def absorb(self, new: torch.Tensor) -> None:
        """Compute weights were edited: carry changed elements into the master file."""
        new = new.to("cpu")
        master = read_range(self.nvme, self.master)
        changed = new != master.to(new.dtype)
        if bool(changed.any()):
            master[changed] = new[changed].float()
            self.nvme.write(self.master, master).wait()
        self.out16[changed] = new[changed].to(self.out16.dtype)
