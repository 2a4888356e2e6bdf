"""What a checkpoint holds and where: the layout record and the resharding arithmetic.

[Note: checkpoint layout]
A tag directory holds
    meta.json                 this file's `describe()`: every unit's layout, every parameter's
                              name / shape / dtype / offset, the files of the tag and their sizes
    common.pt                 rank 0: client_state, lr scheduler, loss scaler, counters,
                              optimizer param_groups and per-unit scalar optimizer state (`step`),
                              module buffers
    rank{r:05d}.safetensors   rank r's saved range of every unit, one 1-D tensor per kind:
                              `{unit}/master` (fp32, or the unit's `master_dtype`: bf16 with
                              bf16.bf16_master_weights_and_grads; trainable units), `{unit}/optim.{key}`
                              (optimizer state shaped like the master: exp_avg, ...),
                              `{unit}/weights` (compute dtype; frozen units, which have no master)
    rank{r:05d}.pt            rank r's RNG states and data-loader position
    config.json               rank 0, transformers models only: `model.config`, which `zerokit
                              convert` copies beside the weights (from_pretrained needs it)
Rank r's saved range of a unit is always elements [r * shard_numel, (r + 1) * shard_numel) of
the unit's flat buffer (see [Note: unit layout]), at every stage: where the state is partitioned
that is what the rank owns; where it is replicated (stage 0, or the weights below stage 3) every
rank owns it all and writes only that slice, so writes are parallel and nothing is written twice.
16-bit compute weights of trainable units are not saved: they are the master rounded.

Reading is the overlap of ranges: parameter p lies at [offset, offset + numel) of its saved unit,
so its element i is in rank (offset + i) // shard_numel's file at (offset + i) % shard_numel.
The ranges a rank now owns (its optimizer range, any world size, any stage) are mapped through
the parameters they cover, so loading never needs the saved world size, stage or unit boundaries
to match.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch.nn as nn

from zerokit.checkpoint.interface import UnitRecord
from zerokit.checkpoint.storage import DTYPE_NAMES

FORMAT = "zerokit-checkpoint"
VERSION = 1
META = "meta.json"
COMMON = "common.pt"
MODEL_CONFIG = "config.json"
IN_USE = "weights_in_use"  # the compute weights while a delayed host update is pending


def shard_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def done_marker(rank: int) -> str:
    return f"rank{rank:05d}.done"


def values_kind(unit_meta: dict) -> str:
    """The saved tensor that holds a unit's values: the fp32 master, or a frozen unit's weights."""
    return "master" if unit_meta["trainable"] else "weights"


def saved_range(unit: UnitRecord, rank: int) -> tuple[int, int]:
    return rank * unit.shard_numel, (rank + 1) * unit.shard_numel


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """Every other name of a tied parameter -> the name the state dict keeps for it."""
    canonical = {id(p): n for n, p in module.named_parameters()}
    return {n: canonical[id(p)] for n, p in module.named_parameters(remove_duplicate=False)
            if canonical[id(p)] != n}


def describe(units: list[UnitRecord], world_size: int, stage: int, aliases: dict[str, str],
             optim_keys: dict[str, list[str]]) -> dict:
    """The layout part of meta.json (files are added at commit)."""
    described = []
    for u in units:
        described.append({
            "name": u.name, "numel": u.numel, "padded_numel": u.padded_numel,
            "shard_numel": u.shard_numel, "trainable": u.trainable, "group_index": u.group_index,
            "ranges": [list(saved_range(u, r)) for r in range(world_size)],
            "optim_keys": optim_keys.get(u.name, []),
            "master_dtype": DTYPE_NAMES[u.master_dtype],
            "params": [{"name": p.fqn, "shape": list(p.shape), "dtype": DTYPE_NAMES[u.compute_dtype],
                        "offset": p.offset, "numel": p.numel} for p in u.params],
        })
    return {"format": FORMAT, "version": VERSION, "world_size": world_size, "stage": stage,
            "compute_dtype": DTYPE_NAMES[units[0].compute_dtype],
            "aliases": aliases, "units": described}


@dataclass(frozen=True)
class SavedParam:
    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    unit: dict


@dataclass(frozen=True)
class Piece:
    """Elements [lo, hi) of tensor `tensor` in rank `rank`'s file go to [dst_lo, dst_hi) of the target."""

    rank: int
    tensor: str
    lo: int
    hi: int
    dst_lo: int
    dst_hi: int


class Layout:
    """The saved layout, indexed by parameter name."""

    def __init__(self, meta: dict):
        self.meta = meta
        self.world_size = meta["world_size"]
        self.params: dict[str, SavedParam] = {}
        for u in meta["units"]:
            for p in u["params"]:
                self.params[p["name"]] = SavedParam(p["name"], tuple(p["shape"]), p["offset"], p["numel"], u)
        self.aliases: dict[str, str] = meta.get("aliases", {})

    def pieces(self, name: str, kind: str, lo: int, hi: int, dst_lo: int) -> Iterator[Piece]:
        """Where elements [lo, hi) of parameter `name` lie in the rank files (kind: master, optim.*)."""
        p = self.params[name]
        shard = p.unit["shard_numel"]
        tensor = f"{p.unit['name']}/{values_kind(p.unit) if kind == 'values' else kind}"
        pos, end = p.offset + lo, p.offset + hi
        while pos < end:
            rank = pos // shard
            stop = min(end, (rank + 1) * shard)
            yield Piece(rank, tensor, pos - rank * shard, stop - rank * shard,
                        dst_lo + pos - p.offset - lo, dst_lo + stop - p.offset - lo)
            pos = stop


def overlaps(slots, a: int, b: int) -> Iterator[tuple[object, int, int]]:
    """(slot, lo, hi): the part [lo, hi) of each parameter (its own element index) in [a, b)."""
    for s in slots:
        lo, hi = max(s.offset, a), min(s.offset + s.numel, b)
        if lo < hi:
            yield s, lo - s.offset, hi - s.offset


def check_names(layout: Layout, units: list[UnitRecord], strict: bool) -> list[str]:
    """Missing / unexpected parameters and shape mismatches, as DeepSpeed/torch name them.

    Returns the names of this engine's parameters the checkpoint has (the ones to load).
    """
    ours = {p.fqn: tuple(p.shape) for u in units for p in u.params}
    mismatched = [f"{n}: checkpoint has shape {list(layout.params[n].shape)}, the model has {list(shape)}"
                  for n, shape in ours.items() if n in layout.params and layout.params[n].shape != shape]
    if mismatched:
        raise RuntimeError("size mismatch loading the checkpoint:\n  " + "\n  ".join(mismatched))
    missing = sorted(set(ours) - set(layout.params))
    unexpected = sorted(set(layout.params) - set(ours))
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing keys (in the model, not in the checkpoint): {missing}")
        if unexpected:
            parts.append(f"unexpected keys (in the checkpoint, not in the model): {unexpected}")
        raise RuntimeError("error loading the checkpoint (load_module_strict=True): " + "; ".join(parts))
    return [n for n in ours if n in layout.params]

