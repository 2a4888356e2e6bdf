"""A checkpoint checks itself: each shard file against the plan its metadata records.

[Note: self-checking checkpoints]
meta.json (see [Note: checkpoint layout]) is the plan: for every unit, rank r's saved range, so
the number of elements of each of `{unit}/master`, `{unit}/optim.{key}` (fp32) and
`{unit}/weights` (the compute dtype) in `rank{r}.safetensors`. The plan is computed from the
units, the files from the snapshot of the state; a snapshot that disagrees with the plan (a
range cut wrong, a state tensor of another size) would write a file that reads back wrong at
the next load. So:
- at save, before the tag is committed (renamed into place, `latest` moved), rank 0 checks every
  rank's file header against the plan and the file's size against its header; any difference
  fails the save on every rank, naming the file, and `latest` keeps naming the previous tag;
- at load, every file listed is checked the same way (headers only: a few KB per rank file), so
  a checkpoint whose files disagree with its metadata (edited, mixed from two saves, truncated)
  is refused naming the file, instead of loading shifted or partial values.
"""
from __future__ import annotations

import json
import os
import struct

from zerokit.checkpoint.metadata import IN_USE, shard_file
from zerokit.checkpoint.storage import DTYPE_BY_NAME, DTYPES


class CheckpointMismatchError(RuntimeError):
    """A shard file disagrees with the checkpoint's metadata; the message names the file."""


def planned_tensors(meta: dict, rank: int) -> dict[str, tuple[str | None, int]]:
    """name -> (safetensors dtype, or None where the plan does not fix it; element count) of
    every tensor rank `rank`'s shard file must hold."""
    planned: dict[str, tuple[str | None, int]] = {}
    compute = DTYPES[DTYPE_BY_NAME[meta["compute_dtype"]]]
    for u in meta["units"]:
        lo, hi = u["ranges"][rank]
        if u["trainable"]:
            master = u.get("master_dtype")  # absent before issue #27: fp32
            planned[f"{u['name']}/master"] = (DTYPES[DTYPE_BY_NAME[master]] if master else "F32", hi - lo)
            for key in u["optim_keys"]:
                planned[f"{u['name']}/optim.{key}"] = (None, hi - lo)  # the optimizer's dtype
        else:
            planned[f"{u['name']}/weights"] = (compute, hi - lo)
    return planned


def _read_header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        body = f.read(n)
        if len(body) < n:
            raise ValueError(f"its header claims {n} bytes and the file ends before")
        return json.loads(body), 8 + n


def shard_problems(path: str, meta: dict, rank: int) -> list[str]:
    """What in rank `rank`'s shard file at `path` disagrees with the plan in `meta` (empty: none)."""
    name = os.path.basename(path)
    try:
        header, data_start = _read_header(path)
    except (OSError, ValueError) as e:  # json errors are ValueErrors
        return [f"{name}: unreadable header ({e})"]
    problems, end = [], 0
    for tensor, (dtype, numel) in planned_tensors(meta, rank).items():
        entry = header.get(tensor)
        if entry is None:
            problems.append(f"{name}: lacks tensor {tensor!r}, which the metadata plans")
            continue
        got = 1
        for d in entry["shape"]:
            got *= d
        if got != numel or (dtype is not None and entry["dtype"] != dtype):
            problems.append(f"{name}: tensor {tensor!r} is {entry['dtype']} x {got} elements, the "
                            f"metadata plans {dtype or 'any dtype'} x {numel}")
    for tensor, entry in header.items():
        if tensor == "__metadata__":
            continue
        end = max(end, entry["data_offsets"][1])
        if tensor not in planned_tensors(meta, rank) and not tensor.endswith("/" + IN_USE):
            problems.append(f"{name}: holds tensor {tensor!r}, which the metadata does not plan")
    size = os.path.getsize(path)
    if size != data_start + end:
        problems.append(f"{name}: {size} bytes on disk, its header describes {data_start + end}")
    return problems


def check_shard_files(tag_dir: str, meta: dict, what: str) -> None:
    """Raise CheckpointMismatchError naming every shard file of the tag that disagrees with
    `meta`. `what` says which checkpoint, for the message ("checkpoint X (being saved)")."""
    problems = []
    for rank in range(meta["world_size"]):
        problems += shard_problems(os.path.join(tag_dir, shard_file(rank)), meta, rank)
    if problems:
        raise CheckpointMismatchError(f"{what}: its files disagree with its metadata: "
                                      + "; ".join(problems))
