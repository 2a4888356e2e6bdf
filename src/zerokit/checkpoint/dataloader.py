"""A DistributedSampler that knows how far the current epoch has been read, and resumes there.

The engine's own data loader (`initialize(training_data=...)`) uses it. Position = (epoch,
indices handed out in this pass). The loader has no worker processes, so the sampler is pulled
one batch at a time as batches are consumed and the count is exactly what training consumed.
A loader with workers prefetches; this count would then run ahead of training by the prefetch.
"""
from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.consumed = 0   # indices handed out in the current pass of the current epoch
        self._skip = 0      # indices to skip at the start of the next pass (set by a load)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start, self._skip = min(self._skip, len(indices)), 0
        self.consumed = start
        for i in indices[start:]:
            self.consumed += 1
            yield i

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "num_replicas": self.num_replicas}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        """Resume at the saved position; at another world size, at the same global sample count."""
        self.set_epoch(sd["epoch"])
        self._skip = sd["consumed"] * sd["num_replicas"] // self.num_replicas
        self.consumed = self._skip
