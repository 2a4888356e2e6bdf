"""engine.load_checkpoint: validate the tag, reshard by parameter name, restore everything.

Each rank reads only the element ranges it now owns (its optimizer range; the whole unit where the
weights are replicated and the unit has no master), from whichever saved ranks' files hold them:
see [Note: checkpoint layout]. The saved world size, stage and dtype need not match. The engine
decides what to load into and in which order (`engine.restore_state`, [Note: checkpoint
interface]); this module answers each `LoadPiece` from the saved files.
"""
from __future__ import annotations

import json
import logging
import os
import random
import zlib
from typing import Any

import numpy as np
import torch

from zerokit.checkpoint.interface import (Checkpointable, FileRange, LoadPiece, SavedOptimizer, SavedUnitOptimizer,
                                          UnitRecord)
from zerokit.checkpoint.metadata import COMMON, FORMAT, META, Layout, check_names, overlaps, rank_file, shard_file
from zerokit.checkpoint.save import LATEST, _sampler, persistent_buffers, wait_for_checkpoint
from zerokit.checkpoint.storage import ShardFile
from zerokit.checkpoint.verify import check_shard_files

log = logging.getLogger("zerokit")


class IncompleteCheckpointError(RuntimeError):
    """The tag is torn (a save that did not finish, or files lost since): it is never loaded."""


def resolve_tag(load_dir: str, tag: Any) -> str | None:
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, LATEST)
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return f.read().strip()


def committed_path(path: str) -> str:
    """The directory that holds tag directory `path`'s checkpoint: `path` itself, or its old copy
    `.old-{tag}` where a save re-using the tag was killed between moving the old copy aside and
    moving the new one in (see save.py, commit). The old copy is whole, and it is what `latest`
    named; the next save moves it back (save.recover_interrupted)."""
    if os.path.isdir(path):
        return path
    old = os.path.join(os.path.dirname(path), f".old-{os.path.basename(path)}")
    if os.path.isfile(os.path.join(old, META)):
        log.warning("checkpoint %s: a save re-using the tag was interrupted; reading its previous "
                    "copy %s", path, old)
        return old
    return path


def read_meta(path: str) -> dict:
    """meta.json of a complete tag, after checking that every file it lists is there, whole."""
    tag_dir, tag = os.path.dirname(path), os.path.basename(path)
    if not os.path.isdir(path):
        tmp = os.path.join(tag_dir, f".tmp-{tag}")
        if os.path.isdir(tmp):
            raise IncompleteCheckpointError(
                f"checkpoint {path} was never completed: only its temporary directory {tmp} exists "
                f"(a save that did not finish); load an earlier tag")
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    meta_path = os.path.join(path, META)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"checkpoint {path} is incomplete: {META} is missing") from None
    except json.JSONDecodeError as e:
        raise IncompleteCheckpointError(f"checkpoint {path} is incomplete: {META} is torn ({e})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a zerokit checkpoint (format {meta.get('format')!r})")
    problems = []
    for name, size in meta["files"].items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            problems.append(f"{name} is missing")
        elif os.path.getsize(file) != size:
            problems.append(f"{name} has {os.path.getsize(file)} bytes, expected {size}")
    expected = {shard_file(r) for r in range(meta["world_size"])} | {COMMON}
    problems += [f"{name} is not listed" for name in sorted(expected - set(meta["files"]))]
    if problems:
        raise IncompleteCheckpointError(f"checkpoint {path} is incomplete: " + "; ".join(problems))
    check_shard_files(path, meta, f"checkpoint {path}")  # [Note: self-checking checkpoints]
    return meta


class SavedTensors:
    """Rank files of one tag opened on demand; reads the pieces of a parameter range."""

    def __init__(self, path: str, layout: Layout):
        self.path, self.layout = path, layout
        self.files: dict[int, ShardFile] = {}

    def read(self, name: str, kind: str, lo: int, hi: int, out: torch.Tensor, dst_lo: int) -> None:
        for piece in self.layout.pieces(name, kind, lo, hi, dst_lo):
            f = self.files.get(piece.rank)
            if f is None:
                f = self.files[piece.rank] = ShardFile(os.path.join(self.path, shard_file(piece.rank)))
            f.read_range(piece.tensor, piece.lo, piece.hi, out[piece.dst_lo:piece.dst_hi])

    def fill(self, unit: UnitRecord, kind: str, a: int, b: int, out: "torch.Tensor | FileRange", names: set[str],
             zero_rest: bool = False) -> None:
        """out[i] = element a + i of the unit's flat layout, from the saved `kind`. Elements no
        loaded parameter covers (padding, parameters the checkpoint lacks) keep their value, or
        become 0 with zero_rest. `out` is a tensor, or a file range (read, filled, written back)."""
        if isinstance(out, FileRange):
            staging = out.read()
        else:
            staging = out if out.device.type == "cpu" and out.is_contiguous() else out.detach().cpu()
        done = 0
        for s, lo, hi in overlaps(unit.params, a, b):
            if s.fqn in names:
                dst = s.offset + lo - a
                if zero_rest and dst > done:
                    staging[done:dst].zero_()
                self.read(s.fqn, kind, lo, hi, staging, dst)
                done = dst + hi - lo
        if zero_rest and done < b - a:
            staging[done:].zero_()
        if isinstance(out, FileRange):
            out.write(staging)
        elif staging is not out:
            out.copy_(staging)

    def filler(self, names: set[str]):
        """The `fill` an engine's restore_state calls for each piece (names: parameters to load)."""
        def fill(piece: LoadPiece) -> None:
            self.fill(piece.unit, piece.kind, piece.lo, piece.hi, piece.target, names, piece.zero_rest)
        return fill

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def load_checkpoint(engine: Checkpointable, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, load_rng_states: bool = False
                    ) -> tuple[str | None, dict | None]:
    """Collective. Returns (tag directory, client_state), or (None, None) if there is no `latest`.

    load_rng_states: also set this process's global torch (and CUDA), numpy and python RNG states
    to what this rank saved, for a resume that draws what the uninterrupted run would have drawn.
    Off by default, as DeepSpeed, which never touches them: a script that seeds and then resumes
    must keep its own stream."""
    wait_for_checkpoint(engine)
    engine.comm.barrier("load_checkpoint (previous saves committed)")
    units = engine.checkpoint_units()
    opened = _open_on_every_rank(engine, units, load_dir, tag, load_module_strict)
    if opened is None:
        log.warning("no 'latest' file in %s: nothing loaded (pass tag= to load a specific one)", load_dir)
        return None, None
    path, layout, names, common, saved = opened
    optimizer = None
    try:
        if load_optimizer_states and not load_module_only:
            optimizer = saved_optimizer(layout, units, names, common)
        engine.restore_state(saved.filler(names), optimizer)
    finally:
        saved.close()
    _load_buffers(engine, common["buffers"], load_module_strict)
    if not load_module_only:
        engine.restore_training_scalars(common, optimizer=load_optimizer_states,
                                        lr_scheduler=load_lr_scheduler_states)
        _load_rank_state(engine, path, load_rng_states)
    engine.comm.barrier("load_checkpoint")
    return path, common["client_state"]


def saved_optimizer(layout: Layout, units: list[UnitRecord], names: set[str], common: dict) -> SavedOptimizer:
    """What the checkpoint holds for each of this engine's trainable units' optimizer state: the
    state keys of the saved units its parameters come from (they must agree), their scalars, and
    the host step counts ([Note: host step counts] in engine/checkpoint_state.py)."""
    record = common.get("offload")
    per_unit: dict[str, SavedUnitOptimizer] = {}
    for u in units:
        if not u.trainable:
            continue
        sources = {layout.params[p.fqn].unit["name"]: layout.params[p.fqn].unit
                   for p in u.params if p.fqn in names}
        if not sources:
            continue
        keysets = {tuple(m["optim_keys"]) for m in sources.values() if m["trainable"]}
        if len(keysets) != 1:
            raise ValueError(f"unit {u.name}: its parameters come from saved units with different "
                             f"optimizer state ({sorted(keysets)}); cannot merge them")
        (keys,) = keysets
        first = next(iter(sources))
        steps = record["host_steps"].get(first) if record is not None else None
        per_unit[u.name] = SavedUnitOptimizer(tuple(keys), common["optim_scalars"].get(first, {}),
                                              None if steps is None else int(steps))
    counters = common["counters"]
    launches = (record["launches"] if record is not None
                else counters["global_steps"] - counters["skipped_steps"])
    return SavedOptimizer(common["param_groups"], per_unit, launches,
                          record is not None and record["pending_write_back"])


def _open_on_every_rank(engine: Checkpointable, units: list[UnitRecord], load_dir: str, tag: Any, strict: bool):
    """Resolves, validates and opens the tag; then every rank learns how the others fared (one
    all-reduce), before the loading collectives. A rank that failed alone would otherwise leave
    the others in the weight gathers until the communication timeout."""
    opened, err = None, None
    try:
        resolved = resolve_tag(load_dir, tag)
        if resolved is not None:
            path = committed_path(os.path.join(load_dir, resolved))
            layout = Layout(read_meta(path))
            names = set(check_names(layout, units, strict))
            common = torch.load(os.path.join(path, COMMON), map_location="cpu", weights_only=False)
            opened = (path, layout, names, common, SavedTensors(path, layout))
    except Exception as e:  # noqa: BLE001 - raised below, after the other ranks have heard
        err = e
    # 0: opened, 1: no `latest` (nothing to load), 2: failed; plus which tag each rank resolved,
    # so that ranks reading different `latest` files (a directory not shared) are caught too.
    state = 2 if err is not None else (1 if opened is None else 0)
    tag_id = zlib.crc32(os.path.basename(opened[0]).encode()) if opened else 0
    codes = engine.comm.flags_by_rank(tag_id * 4 + state, "load_checkpoint (opening the tag)")
    states, tags = [c % 4 for c in codes], [c // 4 for c in codes]
    failed = [r for r, s in enumerate(states) if s == 2]
    problem = None
    if failed:
        problem = (f"rank(s) {failed} could not open the checkpoint in {load_dir!r} (their own "
                   f"errors say why)")
    elif len(set(states)) > 1:
        problem = (f"rank(s) {[r for r, s in enumerate(states) if s == 1]} found no 'latest' file "
                   f"in {load_dir!r} while the others did: is it on a filesystem every rank sees?")
    elif len(set(tags)) > 1:
        problem = (f"the ranks resolved different tags in {load_dir!r} (per-rank 'latest' files "
                   f"differ): pass tag= or share the directory")
    if problem is None:
        return opened
    if opened is not None:
        opened[4].close()
    if err is not None:
        raise err
    raise RuntimeError(f"load_checkpoint: {problem}; nothing was loaded on any rank")


def _load_buffers(engine: Checkpointable, buffers: dict[str, torch.Tensor], strict: bool) -> None:
    ours = dict(persistent_buffers(engine.module))
    missing = sorted(set(ours) - set(buffers))
    if strict and missing:
        raise RuntimeError(f"error loading the checkpoint: missing buffers {missing}")
    with torch.no_grad():
        for name, buf in ours.items():
            if name in buffers:
                if buffers[name].shape != buf.shape:
                    raise RuntimeError(f"size mismatch for buffer {name}: checkpoint has shape "
                                       f"{list(buffers[name].shape)}, the model has {list(buf.shape)}")
                buf.copy_(buffers[name])


def _load_rank_state(engine: Checkpointable, path: str, rng_states: bool) -> None:
    """This rank's data-loader position, and its RNG states where asked."""
    rank_path = os.path.join(path, rank_file(engine.comm.rank))
    saved_here = os.path.exists(rank_path)
    if not saved_here:  # more ranks than were saved: the data position is global, the RNG
        # streams are not
        rank_path = os.path.join(path, rank_file(0))
        if rng_states:
            log.warning("%s has no RNG state for rank %d (saved by fewer ranks): its RNG is not "
                        "restored", path, engine.comm.rank)
    rank_state = torch.load(rank_path, map_location="cpu", weights_only=False)
    if saved_here and rng_states:
        rng = rank_state["rng"]
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    sampler = _sampler(engine)
    if sampler is not None and rank_state["dataloader"] is not None:
        sampler.load_state_dict(rank_state["dataloader"])
