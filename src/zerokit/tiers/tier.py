"""A tier allocates, frees and copies; every allocation is counted by the ledger as it happens.

The ledger's numbers are therefore the bytes the tiers allocated, not a second count kept by hand:
a plan, the start-up report, a budget and a test all read what was allocated. `DeviceTier` holds
the compute device's memory (the CPU itself on a CPU-only run, which the ledger still calls
"device"), `HostTier` host memory, page-locked where a buffer crosses to a CUDA device. The NVMe
tier (tiers/nvme.py: file ranges through io/aio.py) implements the same three operations.

Copies return a `CopyHandle`: on CUDA the copy runs on the side stream (tiers/transfer.py) and
`wait()` orders the current stream after it; elsewhere it is a synchronous copy and `wait()` is
free.
"""
from __future__ import annotations

import torch

from zerokit.tiers.ledger import Ledger
from zerokit.tier_names import TierName
from zerokit.tiers.transfer import side_stream


class CopyHandle:
    """A copy between tiers in flight; `wait()` makes its result visible to the current stream."""

    def __init__(self, event: "torch.cuda.Event | None" = None, device: torch.device | None = None):
        self._event, self._device = event, device

    def wait(self) -> None:
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)

    def synchronize(self) -> None:
        """Block the host until the copy is done (the source may then be overwritten)."""
        if self._event is not None:
            self._event.synchronize()


class Tier:
    """Memory of one kind, counted under `name` in the ledger."""

    name = ""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger

    def allocate(self, owner: str, kind: str, numel: int, dtype: torch.dtype, *,
                 pinned: bool = False) -> torch.Tensor:
        """A new zeroed 1-D buffer, held in the ledger under `owner` until `free(owner)`."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        self.ledger.check_room(self.name, kind, nbytes, owner)  # before allocating: [Note: budgets]
        t = self._empty(numel, dtype, pinned).zero_()
        self.ledger.hold_bytes(owner, kind, self.name, nbytes)
        return t

    def free(self, owner: str) -> None:
        self.ledger.release(owner)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> CopyHandle:
        """dst <- src; asynchronous (side stream) where one side is a CUDA device. The source is
        recorded on the side stream, so freeing it early does not free it under the copy."""
        cuda = [t.device for t in (dst, src) if t.device.type == "cuda"]
        if not cuda:
            dst.copy_(src)
            return CopyHandle()
        side = side_stream(cuda[0])
        side.wait_stream(torch.cuda.current_stream(cuda[0]))
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            if src.device.type == "cuda":
                src.record_stream(side)
            event = torch.cuda.Event()
            event.record(side)
        return CopyHandle(event, cuda[0])

    def _empty(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        raise NotImplementedError


class DeviceTier(Tier):
    name = TierName.DEVICE

    def __init__(self, ledger: Ledger, device: torch.device):
        super().__init__(ledger)
        self.device = device

    def _empty(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)


class HostTier(Tier):
    name = TierName.HOST

    def _empty(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=pinned and torch.cuda.is_available())


def tiers_for(ledger: Ledger, device: torch.device, nvme=None) -> dict:
    """The tiers a unit on `device` allocates from, by name; `nvme` (a tiers/nvme.py NvmeTier,
    shared by every unit of the engine) where the placement puts anything on NVMe."""
    tiers = {TierName.DEVICE: DeviceTier(ledger, device), TierName.HOST: HostTier(ledger)}
    if nvme is not None:
        tiers[TierName.NVME] = nvme
    return tiers
