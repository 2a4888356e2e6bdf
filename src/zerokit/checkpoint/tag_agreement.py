"""One checkpoint tag for every rank: DeepSpeed's `checkpoint.tag_validation`.

A save is collective and writes one tag directory, so every rank must name the same tag. Code
that puts rank-specific text in the tag (`tag=f"step{n}-rank{rank}"`) would otherwise make each
rank write a different directory and the commit could never find them all. DeepSpeed compares
the tags' hashes across ranks and, by `checkpoint.tag_validation`, fails ("FAIL": an
AssertionError), warns ("WARN", the default) or does nothing ("IGNORE"); then each rank saves
under its own tag, which leaves a checkpoint no rank can load whole. zerokit compares the same
way and fails for "FAIL"; for "WARN" (with a warning) and "IGNORE" every rank saves under rank
0's tag, so the checkpoint is complete (docs/deepspeed.md, "Different from DeepSpeed").
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("zerokit")

MODES = ("WARN", "IGNORE", "FAIL")


class CheckpointTagMismatch(ValueError, AssertionError):
    """checkpoint.tag_validation "FAIL" and the ranks gave different tags. An AssertionError as
    DeepSpeed's (its check is an assert), and a ValueError: the argument is wrong."""


def agree_on_tag(comm, tag: str, mode: str) -> str:
    """Collective (at world size > 1): the tag every rank saves under, rank 0's."""
    if comm.world_size == 1:
        return tag
    mine = tag.encode()
    length = torch.tensor([len(mine)], dtype=torch.int64, device=comm.device)
    comm.broadcast_(length, 0, "checkpoint tag length")
    theirs = torch.zeros(int(length.item()), dtype=torch.uint8, device=comm.device)
    if comm.rank == 0:
        theirs.copy_(torch.frombuffer(bytearray(mine), dtype=torch.uint8))
    comm.broadcast_(theirs, 0, "checkpoint tag")
    rank0_tag = bytes(theirs.cpu().tolist()).decode()
    differs = comm.max_flag(float(rank0_tag != tag), "checkpoint tag comparison") > 0
    if not differs:
        return tag
    what = (f"[rank={comm.rank}] The checkpoint tag name '{tag}' is not consistent across all ranks "
            f"(rank 0: '{rank0_tag}'). Including rank unique information in checkpoint tag could "
            f"cause issues when restoring with different world sizes.")
    if mode == "FAIL":
        raise CheckpointTagMismatch(f"{what} checkpoint.tag_validation is 'Fail'; pass the same tag "
                                    f"on every rank")
    if mode == "WARN":
        log.warning("%s Every rank saves under rank 0's tag '%s' (checkpoint.tag_validation 'Warn'; "
                    "'Ignore' silences this).", what, rank0_tag)
    return rank0_tag
