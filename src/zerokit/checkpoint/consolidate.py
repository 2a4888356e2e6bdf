"""One model from a sharded checkpoint, offline, one saved unit in memory at a time.

`iter_units` assembles each saved unit's full values (fp32 master, or a frozen unit's weights)
from every rank's file and yields its parameters; nothing else of the checkpoint is in memory.
`convert` streams them into safetensors: the header is known from meta.json before any value is
read, so each file is written front to back as units arrive (Hugging Face's sharded layout with
`model.safetensors.index.json` above `max_shard_bytes`). Memory bound: the largest unit's padded
fp32 values plus its parameters in the output dtype (~2x the largest unit in fp32).
Tied parameters are written once, under their first name, as Hugging Face does; the state dict of
`get_fp32_state_dict` names every alias, as `model.state_dict()` does.
"""
from __future__ import annotations

import json
import os
from typing import Iterator

import torch

from zerokit.checkpoint.load import committed_path, read_meta, resolve_tag
from zerokit.checkpoint.metadata import COMMON, MODEL_CONFIG, Layout, shard_file, values_kind
from zerokit.checkpoint.storage import DTYPE_OF, SafetensorsWriter, ShardFile, write_bytes_atomic


def resolve_path(checkpoint_dir: str, tag: str | None = None) -> str:
    """A tag directory, given it or the directory holding tags and `latest`."""
    if tag is None and os.path.isfile(os.path.join(checkpoint_dir, "meta.json")):
        return checkpoint_dir
    resolved = resolve_tag(checkpoint_dir, tag)
    if resolved is None:
        raise FileNotFoundError(f"{checkpoint_dir} has no 'latest' file and no tag was given")
    return committed_path(os.path.join(checkpoint_dir, resolved))


def iter_units(path: str, meta: dict) -> Iterator[tuple[dict, dict[str, torch.Tensor]]]:
    """(unit metadata, {name: values}) per saved unit, in the saved order."""
    files = [ShardFile(os.path.join(path, shard_file(r))) for r in range(meta["world_size"])]
    try:
        for u in meta["units"]:
            name = f"{u['name']}/{values_kind(u)}"
            parts = []
            for f in files:
                part = torch.empty(u["shard_numel"], dtype=DTYPE_OF[f.header[name]["dtype"]])
                f.read_range(name, 0, u["shard_numel"], part)
                parts.append(part)
            full = torch.cat(parts)
            yield u, {p["name"]: full[p["offset"]:p["offset"] + p["numel"]].view(p["shape"])
                      for p in u["params"]}
    finally:
        for f in files:
            f.close()


def buffers(path: str) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(path, COMMON), map_location="cpu", weights_only=False)["buffers"]


def get_fp32_state_dict(checkpoint_dir: str, tag: str | None = None,
                        include_buffers: bool = True) -> dict[str, torch.Tensor]:
    path = resolve_path(checkpoint_dir, tag)
    meta = read_meta(path)
    out: dict[str, torch.Tensor] = {}
    for _, params in iter_units(path, meta):
        out.update({k: v.clone().float() for k, v in params.items()})
    for alias, canonical in Layout(meta).aliases.items():
        out[alias] = out[canonical]
    if include_buffers:
        out.update({k: v.float() if v.is_floating_point() else v for k, v in buffers(path).items()})
    return out


def convert(checkpoint_dir: str, out_dir: str, dtype: torch.dtype = torch.float32, tag: str | None = None,
            max_shard_bytes: int = 5 * 2**30, filename: str = "model.safetensors") -> list[str]:
    """Write the checkpoint's model as safetensors in `out_dir`; returns the files written."""
    path = resolve_path(checkpoint_dir, tag)
    meta = read_meta(path)
    bufs = buffers(path)
    size = torch.empty((), dtype=dtype).element_size()
    # Plan from metadata: which unit's tensors (and, last, the buffers) go to which file.
    plan: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[]]
    used = 0
    for u in meta["units"]:
        nbytes = u["numel"] * size
        if plan[-1] and used + nbytes > max_shard_bytes:
            plan.append([])
            used = 0
        plan[-1] += [(p["name"], dtype, tuple(p["shape"])) for p in u["params"]]
        used += nbytes
    plan[-1] += [(k, _out_dtype(v, dtype), tuple(v.shape)) for k, v in bufs.items()]
    stem, ext = os.path.splitext(filename)
    names = [filename] if len(plan) == 1 else [f"{stem}-{i + 1:05d}-of-{len(plan):05d}{ext}"
                                               for i in range(len(plan))]
    os.makedirs(out_dir, exist_ok=True)
    file_of = {entry[0]: i for i, entries in enumerate(plan) for entry in entries}
    writers: dict[int, SafetensorsWriter] = {}
    done = []
    units = iter_units(path, meta)
    try:
        for i, entries in enumerate(plan):
            tmp = os.path.join(out_dir, names[i] + ".tmp")
            writers[i] = SafetensorsWriter(tmp, entries, {"format": "pt"})
            pos = 0
            while pos < len(entries):
                name = entries[pos][0]
                if name in bufs:
                    writers[i].write(name, bufs[name].to(_out_dtype(bufs[name], dtype)))
                    pos += 1
                    continue
                _, params = next(units)  # the plan puts whole units, in order, into each file
                for k, v in params.items():
                    writers[i].write(k, v.to(dtype))
                    pos += 1
            writers.pop(i).close()
            os.replace(tmp, os.path.join(out_dir, names[i]))
            done.append(os.path.join(out_dir, names[i]))
    finally:
        units.close()
        for w in writers.values():
            w.abort()
    if MODEL_CONFIG in meta["files"]:
        done.append(_write_model_config(path, out_dir, dtype))
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
                                                for entries in plan for _, d, s in entries)},
                 "weight_map": {k: names[i] for k, i in file_of.items()}}
        index_path = os.path.join(out_dir, f"{filename}.index.json")
        write_bytes_atomic(index_path, json.dumps(index, indent=2).encode())
        done.append(index_path)
    return done


def _write_model_config(path: str, out_dir: str, dtype: torch.dtype) -> str:
    """The saved transformers config.json beside the weights, so `from_pretrained(out_dir)` works
    (as `save_pretrained` writes it: the dtype entry names the weights' dtype)."""
    with open(os.path.join(path, MODEL_CONFIG)) as f:
        config = json.load(f)
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = str(dtype).replace("torch.", "")
    out = os.path.join(out_dir, MODEL_CONFIG)
    write_bytes_atomic(out, json.dumps(config, indent=2, sort_keys=True).encode())
    return out


def _out_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    return dtype if t.is_floating_point() else t.dtype
