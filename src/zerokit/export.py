"""Writing the consolidated 16-bit model as safetensors, one unit in memory at a time.

The safetensors layout (8-byte header length, JSON header of dtype/shape/offsets, raw bytes) is
known before any weight is gathered, so rank 0 writes the header first and streams each unit's
tensors into place as the unit is gathered: memory stays at one unit, never the model. Above
`max_shard_bytes` the model goes into several files plus Hugging Face's index JSON. Files are
written under a temporary name, fsynced and renamed, so a crash never leaves a half file
under the final name. Tied weights are stored once, under their first name, as Hugging Face does.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from zerokit.checkpoint.storage import SafetensorsWriter
from zerokit.units.unit import WeightState

if TYPE_CHECKING:
    from zerokit.engine.engine import Engine


def _behind_master(engine: "Engine", unit) -> bool:
    """With the delayed host update, the weights of a unit's host part are written back only at
    the next step, while consolidated_fp32_state_dict already reads the updated master (waiting
    for the update in flight): the export must agree with it. The same on every rank."""
    return any(e.pending_write_back and any(p.unit is unit for p in e.shards)
               for e in engine.kernel_executors)


def save_16bit_model(engine: "Engine", save_dir: str, save_filename: str = "model.safetensors",
                     max_shard_bytes: int = 5 * 2**30, exclude_frozen_parameters: bool = False) -> list[str]:
    """Collective: every rank gathers unit by unit; rank 0 writes. Returns the files written."""
    engine.wait_for_weights()
    units = [u for u in engine.units if u.trainable or not exclude_frozen_parameters]
    # Plan: which unit's tensors go to which file, from metadata alone.
    plan: list[list] = [[]]
    size = 0
    for u in units:
        nbytes = u.numel * u.flat.element_size()
        if plan[-1] and size + nbytes > max_shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append(u)
        size += nbytes
    stem, ext = os.path.splitext(save_filename)
    names = [save_filename] if len(plan) == 1 else [
        f"{stem}-{i + 1:05d}-of-{len(plan):05d}{ext}" for i in range(len(plan))]
    rank0 = engine.comm.rank == 0
    if rank0:
        os.makedirs(save_dir, exist_ok=True)
    weight_map: dict[str, str] = {}
    for file_units, name in zip(plan, names):
        entries = [(s.fqn, u.compute_dtype, tuple(s.shape)) for u in file_units for s in u.slots]
        final = os.path.join(save_dir, name)
        out = SafetensorsWriter(final + ".tmp", entries, {"format": "pt"}) if rank0 else None
        try:
            for u in file_units:
                if _behind_master(engine, u):
                    # Compute weights lag the master: export the master as the compute dtype,
                    # which is what the write-back will store (the kernel's 16-bit output is the
                    # master rounded to nearest, as .to() rounds).
                    latest = u.split(u.full_master().to(u.compute_dtype))
                    if out is not None:
                        for s in u.slots:
                            out.write(s.fqn, latest[s.fqn])
                            weight_map[s.fqn] = name
                    continue
                gathered = u.state is WeightState.SHARDED
                u.gather()
                u.wait_weights()
                if out is not None:
                    for s in u.slots:
                        # A copy: numpy on the live weights would pin their storage, which
                        # stage 3 must resize when it releases the unit.
                        out.write(s.fqn, u.flat[s.offset:s.offset + s.numel].view(s.shape).clone())
                        weight_map[s.fqn] = name
                if gathered:
                    u.release()
            if out is not None:
                out.close()
                os.replace(final + ".tmp", final)
        except BaseException:
            if out is not None:
                out.abort()
                if os.path.exists(final + ".tmp"):
                    os.remove(final + ".tmp")
            raise
    if rank0 and len(names) > 1:
        index = {"metadata": {"total_size": sum(u.numel * u.flat.element_size() for u in units)},
                 "weight_map": weight_map}
        path = os.path.join(save_dir, f"{stem}{ext}.index.json")
        with open(path + ".tmp", "w") as f:
            json.dump(index, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
    engine.comm.barrier("save_16bit_model")
    return [os.path.join(save_dir, n) for n in names]

