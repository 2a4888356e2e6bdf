"""The loader `initialize(training_data=...)` returns (also `engine.training_dataloader`).

A torch DataLoader over a resumable DistributedSampler (checkpoint/dataloader.py: a checkpoint
records how far into the epoch training has read), with the members scripts read on DeepSpeed's
DeepSpeedDataLoader: `data_sampler` (for `set_epoch`), `len`, `dataloader`, and `next(loader)`
without `iter()` first. It always drops the last incomplete batch, so every rank steps the same
number of times (DeepSpeed's `dataloader_drop_last` default is false: docs/deepspeed.md).
"""
from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import DataLoader


class TrainingDataLoader(DataLoader):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._iterator: Iterator | None = None  # for next(loader), as DeepSpeed's loader allows

    @property
    def data_sampler(self):
        """DeepSpeed's name for the sampler."""
        return self.sampler

    @property
    def len(self) -> int:
        """Batches per epoch on this rank (DeepSpeed's attribute; len(loader) too)."""
        return len(self)

    @property
    def dataloader(self) -> "TrainingDataLoader":
        """DeepSpeed's loader wraps a torch DataLoader here; this one is it."""
        return self

    def __next__(self) -> Any:
        """The next batch of the epoch in progress; after its last batch StopIteration, and the
        next call starts a new epoch (as iterating DeepSpeed's loader again does)."""
        if self._iterator is None:
            self._iterator = iter(self)
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = None
            raise
