"""engine.save_checkpoint: snapshot, write in parallel, commit atomically.

The protocol, as four steps (DCP's plan / write / commit, plus an explicit agreement):
1. prepare   rank 0 makes a clean temporary directory `.tmp-{tag}` beside the tags; all agree.
2. snapshot  each rank takes what it owns (see [Note: checkpoint layout]): views of its ranges.
             Asynchronously, device tensors are copied to a host staging buffer (the stall of an
             async save on a GPU); host tensors are written from where they live, and the next
             thing that would change them (`engine.step`, an edit through GatheredParameters)
             first waits until this rank's shard file is written (`settle_checkpoint`), which
             costs nothing when the write finished during the forward and backward in between.
3. write     each rank writes its own files, fsyncs them and then a `rank{r}.done` marker that
             lists them with their sizes. Ranks agree that every write succeeded (one all-reduce
             of a failure flag, which is also the barrier), or rank 0 removes the temporary
             directory and every rank raises.
4. commit    rank 0 checks every marker, writes meta.json (with the file list and sizes),
             fsyncs, renames `.tmp-{tag}` to `{tag}`, fsyncs the parent, then replaces `latest`
             (temp + fsync + os.replace). Until the rename the tag does not exist; until the
             `latest` replace, `latest` names the previous complete tag. A kill at any moment
             therefore leaves the previous checkpoint loadable.
             Re-saving an existing tag takes two renames: the old copy to `.old-{tag}`, then the
             new one in. A kill between them leaves no `{tag}`, and `latest` may name it: loading
             then reads the old copy, whole (load.committed_path), and the next save puts it back
             before anything else (recover_interrupted), or drops an `.old-{tag}` left beside a
             complete `{tag}` (a kill while removing it).
Asynchronously, steps 3-4 run on a background thread per rank with no collectives, on the
engine's save lease (units/lease.py): rank 0's thread waits for the other ranks' markers in the
file system (or a `rank{r}.failed` marker, or the comm timeout) before it commits. The next save,
a load, or `wait_for_checkpoint` waits. What is saved comes through the engine's narrow interface
([Note: checkpoint interface] in checkpoint/interface.py): named pieces of live state, and scalars.

[Note: async save without a host copy] A host copy of the whole shard (0.5 GB per rank in the
benchmark) takes about 0.1 s here, a fifth of the direct write itself, and training would stall
for it at every save. Nothing between two optimizer steps writes the master, the optimizer state
or the weight shards, so the writer can read them in place as long as the next step waits for it.
"""
from __future__ import annotations

import io
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from zerokit.checkpoint.dataloader import ResumableDistributedSampler
from zerokit.checkpoint.interface import Checkpointable, FileRange, HostRecord
from zerokit.checkpoint.metadata import (COMMON, META, MODEL_CONFIG, describe, done_marker, rank_file, shard_file,
                                         tied_aliases)
from zerokit.checkpoint.staging import stage
from zerokit.checkpoint.tag_agreement import agree_on_tag
from zerokit.checkpoint.verify import check_shard_files
from zerokit.checkpoint.storage import (CheckpointWriteError, Parts, fsync_dir, nbytes_of,
                                        save_shard_file, write_bytes_atomic, write_error, write_json)

log = logging.getLogger("zerokit")

LATEST = "latest"


@dataclass
class Snapshot:
    tensors: list[tuple[str, torch.Tensor]]
    rank_bytes: bytes
    common_bytes: bytes | None = None          # rank 0 only
    model_config: bytes | None = None          # rank 0 only: a transformers model's config.json
    meta: dict | None = None                    # rank 0 only
    nbytes: int = 0


def wait_for_checkpoint(engine: Checkpointable) -> None:
    """Block until this rank's asynchronous save (rank 0: including the commit) is finished;
    raises what it failed with."""
    engine.save_lease.wait()


def settle_checkpoint(engine: Checkpointable) -> None:
    """Before training state changes: wait until an asynchronous save of `engine` no longer reads
    it (see [Note: async save without a host copy]). The commit may still be running."""
    engine.save_lease.settle()


def save_checkpoint(engine: Checkpointable, save_dir: str, tag: Any = None, client_state: dict | None = None,
                    save_latest: bool = True) -> str:
    """Collective. Returns the tag directory (it exists once every rank returns, unless async)."""
    if not save_dir:  # as DeepSpeed: None or "" is a mistake, not the current directory
        raise ValueError(f"save_checkpoint: save_dir must be a non-empty string, got {save_dir!r}")
    wait_for_checkpoint(engine)  # the next save waits for the previous one
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    tag = agree_on_tag(engine.comm, tag, engine.config.checkpoint.tag_validation)
    if not tag or os.sep in tag or tag.startswith(".") or tag == LATEST:
        raise ValueError(f"checkpoint tag {tag!r} must be a plain directory name, not starting with "
                         f"'.' (zerokit's temporary names) and not '{LATEST}'")
    if engine.micro_steps % engine.gradient_accumulation_steps():
        log.warning("save_checkpoint in the middle of gradient accumulation (micro-step %d of %d): "
                    "the gradients accumulated so far are not saved", engine.micro_steps %
                    engine.gradient_accumulation_steps(), engine.gradient_accumulation_steps())
    comm, rank = engine.comm, engine.comm.rank
    tmp = os.path.join(save_dir, f".tmp-{tag}")
    async_save = engine.config.checkpoint.async_save

    def prepare() -> None:
        os.makedirs(save_dir, exist_ok=True)
        recover_interrupted(save_dir)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that died
        os.makedirs(tmp)
    _agree(engine, _attempt(prepare, tmp) if rank == 0 else None, "preparing", tmp)

    engine.wait_for_weights()
    snap = snapshot(engine, client_state, copy_tensors=async_save)
    final = os.path.join(save_dir, tag)
    if async_save:
        rank, world, timeout_s = comm.rank, comm.world_size, comm.timeout_s
        engine.save_lease.start(lambda release: _background(release, rank, world, timeout_s, save_dir, tmp, tag,
                                                            snap, save_latest), name=f"zerokit-save-{tag}")
        return final
    _agree(engine, _attempt(lambda: write_rank(tmp, rank, snap), tmp), "writing", tmp)
    if rank == 0:
        err = _attempt(lambda: commit(save_dir, tmp, tag, comm.world_size, snap.meta, save_latest), tmp)
    else:
        err = None
    _agree(engine, err, "committing", tmp)
    return final


def _attempt(fn: Callable[[], None], tmp: str) -> BaseException | None:
    try:
        fn()
    except OSError as e:
        return e if isinstance(e, CheckpointWriteError) else write_error(tmp, e)
    except Exception as e:  # noqa: BLE001 - handed to _agree, which raises it on this rank
        return e
    return None


def _agree(engine: Checkpointable, err: BaseException | None, step: str, tmp: str) -> None:
    """Every rank learns whether any failed (one all-reduce); on failure the tag is removed."""
    failed = engine.comm.max_flag(1.0 if err is not None else 0.0, f"checkpoint save ({step})")
    if not failed:
        return
    if engine.comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if err is not None:
        raise err
    raise RuntimeError(f"checkpoint save failed on another rank while {step}; the partial tag was "
                       f"removed and the previous checkpoint and 'latest' are untouched")


def recover_interrupted(save_dir: str) -> None:
    """Rank 0, before a save (saves are serialised): finish what a killed commit left behind.

    `.old-{tag}` without `{tag}`: killed between the commit's two renames; the old copy is whole
    (it was moved aside by one rename) and is what `latest` may name, so it goes back. Beside a
    complete `{tag}` it is a removal that was interrupted. `latest.tmp*`: a `latest` replace that
    never happened (write_bytes_atomic).
    """
    for entry in os.listdir(save_dir):
        path = os.path.join(save_dir, entry)
        if entry.startswith(".old-") and os.path.isdir(path):
            tag_dir = os.path.join(save_dir, entry[len(".old-"):])
            if os.path.isdir(tag_dir):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.rename(path, tag_dir)
                fsync_dir(save_dir)
                log.warning("checkpoint %s: restored the copy an interrupted save had moved aside", tag_dir)
        elif entry.startswith(f"{LATEST}.tmp") and os.path.isfile(path):
            os.remove(path)


# ---- 2. snapshot ------------------------------------------------------------------------------
def snapshot(engine: Checkpointable, client_state: dict | None, copy_tensors: bool) -> Snapshot:
    rank = engine.comm.rank
    state = engine.state_to_save()
    tensors: list[tuple[str, Parts]] = [(p.name, list(p.segments)) for p in state.pieces]
    # An async save copies device tensors to the staging buffer and writes host tensors (and
    # file ranges) in place (see [Note: async save without a host copy]); a sync save writes the
    # live tensors.
    if copy_tensors:
        on_device = [(n, t) for n, t in tensors if _on_device(t)]
        staged = dict(stage(engine.save_lease, engine.comm.device, on_device)) if on_device else {}
        tensors = [(n, staged.get(n, t)) for n, t in tensors]
    else:
        tensors = [(n, _on_host(t)) for n, t in tensors]
    sampler = _sampler(engine)
    rank_state = {"rng": rng_state(), "dataloader": sampler.state_dict() if sampler is not None else None}
    snap = Snapshot(tensors, _serialize(rank_state))
    snap.nbytes = sum(nbytes_of(t) for _, t in tensors)
    if rank == 0:
        scalars = engine.training_scalars()
        common = {
            "client_state": client_state if client_state is not None else {},
            "lr_scheduler": scalars["lr_scheduler"],
            "loss_scaler": scalars["loss_scaler"],
            "counters": scalars["counters"],
            "param_groups": scalars["param_groups"],
            "optim_scalars": state.optim_scalars,
            "offload": _host_record(state.host),
            "buffers": {n: b.detach().cpu().clone() for n, b in persistent_buffers(engine.module)},
        }
        snap.common_bytes = _serialize(common)
        snap.model_config = model_config_json(engine.module)
        snap.meta = describe(engine.checkpoint_units(), engine.comm.world_size,
                             engine.config.zero_optimization.stage, tied_aliases(engine.module), state.optim_keys)
    return snap


def _host_record(host: HostRecord | None) -> dict[str, Any] | None:
    """common.pt's "offload": the host executor's step counts, launches, a pending write-back."""
    if host is None:
        return None
    return {"host_steps": dict(host.host_steps), "launches": host.launches,
            "pending_write_back": host.pending_write_back}


def _on_device(t: Parts) -> bool:
    return any(not isinstance(p, FileRange) and p.device.type != "cpu" for p in t)


def _on_host(t: Parts) -> Parts:
    return [p if isinstance(p, FileRange) else p.detach().cpu() for p in t]


def model_config_json(module: torch.nn.Module) -> bytes | None:
    """A transformers model's config.json (its `config.to_json_string()`), so that `zerokit convert`
    writes a directory `from_pretrained` loads as it is; None for other models."""
    config = getattr(module, "config", None)
    to_json = getattr(config, "to_json_string", None)
    return to_json().encode() if callable(to_json) else None


def persistent_buffers(module: torch.nn.Module):
    for mod_name, mod in module.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _sampler(engine: Checkpointable) -> ResumableDistributedSampler | None:
    loader = engine.training_dataloader
    sampler = getattr(loader, "sampler", None)
    return sampler if isinstance(sampler, ResumableDistributedSampler) else None


def _serialize(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# ---- 3. write ---------------------------------------------------------------------------------
def write_rank(tmp: str, rank: int, snap: Snapshot) -> None:
    files = {shard_file(rank): save_shard_file(os.path.join(tmp, shard_file(rank)), snap.tensors,
                                               {"format": "pt", "rank": str(rank)})}
    blobs = [(rank_file(rank), snap.rank_bytes)] + ([(COMMON, snap.common_bytes)] if rank == 0 else [])
    if snap.model_config is not None:
        blobs.append((MODEL_CONFIG, snap.model_config))
    for name, data in blobs:
        path = os.path.join(tmp, name)
        try:
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise write_error(path, e) from e
        files[name] = len(data)
    write_json(os.path.join(tmp, done_marker(rank)), {"files": files})


# ---- 4. commit (rank 0) -----------------------------------------------------------------------
def commit(save_dir: str, tmp: str, tag: str, world_size: int, meta: dict, save_latest: bool,
           wait_s: float = 0.0) -> None:
    import json

    files: dict[str, int] = {}
    deadline = time.monotonic() + wait_s
    for r in range(world_size):
        marker = os.path.join(tmp, done_marker(r))
        while not os.path.exists(marker):  # async: wait for the other ranks' threads
            failed = os.path.join(tmp, f"rank{r:05d}.failed")
            if os.path.exists(failed):
                with open(failed) as f:
                    raise RuntimeError(f"checkpoint {tag}: rank {r} failed to write: {f.read()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"checkpoint {tag}: rank {r} did not finish writing ({marker} missing)")
            time.sleep(0.01)
        with open(marker) as f:
            files.update(json.load(f)["files"])
    for name, size in files.items():
        got = os.path.getsize(os.path.join(tmp, name))
        if got != size:
            raise RuntimeError(f"checkpoint {tag}: {name} has {got} bytes, its writer reported {size}")
    # Every file against the plan before the tag exists: see [Note: self-checking checkpoints].
    check_shard_files(tmp, meta, f"checkpoint {tag} (being saved; not committed, 'latest' unchanged)")
    write_json(os.path.join(tmp, META), dict(meta, tag=tag, files=files))
    fsync_dir(tmp)
    final, old = os.path.join(save_dir, tag), os.path.join(save_dir, f".old-{tag}")
    if os.path.exists(final):  # re-saving a tag: move the old one aside, then drop it
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(save_dir)
    shutil.rmtree(old, ignore_errors=True)
    if save_latest:
        write_bytes_atomic(os.path.join(save_dir, LATEST), tag.encode())


def _background(release: Callable[[], None], rank: int, world: int, timeout_s: float, save_dir: str,
                tmp: str, tag: str, snap: Snapshot, save_latest: bool) -> None:
    """An asynchronous save's steps 3-4; `release` ends the read lease once the files are written.
    A failure is raised again by the next save / load / wait_for_checkpoint (ReadLease.wait)."""
    try:
        try:
            write_rank(tmp, rank, snap)
        finally:
            release()
        if rank == 0:
            commit(save_dir, tmp, tag, world, snap.meta, save_latest, wait_s=timeout_s)
    except BaseException as e:
        try:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                write_json(os.path.join(tmp, f"rank{rank:05d}.failed"), str(e))
        except OSError:
            pass
        log.error("asynchronous checkpoint save of %s failed on rank %d: %s", tag, rank, e)
        raise
