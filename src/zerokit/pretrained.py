"""Pretrained safetensors weights streamed into a model built under zero.Init, shard by shard.

    with zerokit.zero.Init(config=ds_config):
        model = MyModel()
    report = zerokit.zero.load_pretrained_sharded(model, "checkpoint_dir")   # or a file, or files
    engine, *_ = zerokit.initialize(model=model, config=ds_config)

[Note: streaming load] Every rank reads only the bytes it keeps. A safetensors header gives each
tensor's dtype, shape and byte offsets, and its data is row-major, so a parameter's flat element
range [a, b) is one contiguous byte range of the file. For a parameter held by a construction unit
(see zero.Init and [Note: unit layout]), this rank owns the intersection of the parameter's slot
with its shard; it reads exactly those elements (checkpoint/storage.py `ShardFile.read_range`) and
writes them into its shard, converting the dtype on the way (a bf16 checkpoint into an fp32
model). No rank ever holds a whole tensor of a partitioned parameter, let alone the whole model,
and no collective is needed: the ranks' reads are disjoint and together cover every element.
Parameters that are not partitioned, and buffers, are read whole on every rank (they are
replicated anyway). In flight at once: the owned part of one tensor (plus its dtype conversion).

Transformers' `from_pretrained` under zero.Init reaches this through compat/hf_pretrained.py; its
default path has rank 0 load every checkpoint tensor into one host state dict first.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable

import psutil
import torch
import torch.nn as nn

from zerokit.units.unit import Unit, WeightState
from zerokit.units.registry import unit_of

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass
class LoadReport:
    """What one rank's load did. Keys are the model's state_dict keys (after `rename`), except
    `unexpected_keys`, which are checkpoint keys the model has no place for."""

    loaded_keys: set[str] = field(default_factory=set)
    missing_keys: set[str] = field(default_factory=set)
    unexpected_keys: set[str] = field(default_factory=set)
    # (model key, checkpoint shape, model shape), as transformers reports them
    mismatched_keys: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=set)
    files: int = 0
    bytes_read: int = 0          # checkpoint bytes this rank read
    largest_read: int = 0        # the largest single read (bytes): what was in flight at once
    peak_rss_delta: int = 0      # this process's RSS growth over the load, at its peak (sampled)

    def summary(self) -> str:
        mib = 1 << 20
        return (f"loaded {len(self.loaded_keys)} tensors from {self.files} safetensors file(s): read "
                f"{self.bytes_read / mib:.2f} MiB on this rank (largest read {self.largest_read / mib:.2f} "
                f"MiB), RSS peak +{self.peak_rss_delta / mib:.2f} MiB; {len(self.missing_keys)} missing, "
                f"{len(self.unexpected_keys)} unexpected, {len(self.mismatched_keys)} mismatched")


def load_pretrained_sharded(model: nn.Module, path_or_files: "str | os.PathLike | Iterable[str]", *,
                            rename: Callable[[str], str] | None = None, strict: bool = False,
                            ignore_mismatched_sizes: bool = False) -> LoadReport:
    """Load safetensors weights into `model`, each rank reading only its shard of each parameter.

    `model` is built under zerokit.zero.Init (not yet passed to initialize); parameters it did not
    partition, and buffers, are loaded whole. `path_or_files` is a directory (with
    model.safetensors.index.json, model.safetensors, or *.safetensors files), one file, or a list
    of files. `rename` maps a checkpoint key to the model's key. Tied parameters (one tensor under
    several keys) load from whichever of their keys the checkpoint has. A shape mismatch raises
    unless `ignore_mismatched_sizes` (then the key is reported and left as built); `strict` raises
    on missing or unexpected keys. Every rank must call it (with the same files); it is not a
    collective. See [Note: streaming load].
    """
    files = checkpoint_files(path_or_files)
    report = LoadReport(files=len(files))
    by_key, handles = _open_files(files)
    try:
        with _RssPeak() as peak:
            _load(model, by_key, rename, report)
        report.peak_rss_delta = peak.delta
    finally:
        for f in handles:
            f.close()
    _check_outcome(report, strict, ignore_mismatched_sizes)
    _log_on_rank0(report)
    return report


# ---- files ---------------------------------------------------------------------------------------
def checkpoint_files(path_or_files: "str | os.PathLike | Iterable[str]") -> list[str]:
    """The safetensors files a directory, a file, or a list of files names, in a stable order."""
    if isinstance(path_or_files, (str, os.PathLike)):
        path = os.fspath(path_or_files)
        if os.path.isdir(path):
            return _files_in_dir(path)
        files = [path]
    else:
        files = [os.fspath(f) for f in path_or_files]
    if not files:
        raise ValueError("load_pretrained_sharded: path_or_files named no file")
    for f in files:
        if not f.endswith(".safetensors"):
            raise ValueError(f"load_pretrained_sharded: {f!r} is not a .safetensors file; only "
                             f"safetensors can be read by element range (convert .bin checkpoints first)")
        if not os.path.isfile(f):
            raise FileNotFoundError(f"load_pretrained_sharded: no file {f!r}")
    return files


def _files_in_dir(path: str) -> list[str]:
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    if os.path.isfile(os.path.join(path, SINGLE_NAME)):
        return [os.path.join(path, SINGLE_NAME)]
    found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"load_pretrained_sharded: {path!r} has no {INDEX_NAME}, no "
                                f"{SINGLE_NAME} and no other .safetensors file")
    return [os.path.join(path, n) for n in found]


def _open_files(files: list[str]) -> tuple[dict, list]:
    """(checkpoint key -> the open file holding it, the open files); only headers are read."""
    from zerokit.checkpoint.storage import ShardFile

    by_key: dict[str, ShardFile] = {}
    handles: list[ShardFile] = []
    try:
        for path in files:
            f = ShardFile(path)
            handles.append(f)
            for name in f.names():
                if name in by_key:
                    raise ValueError(f"load_pretrained_sharded: tensor {name!r} is in both "
                                     f"{by_key[name].path} and {path}")
                by_key[name] = f
    except BaseException:
        for f in handles:
            f.close()
        raise
    return by_key, handles


# ---- matching keys and loading ----------------------------------------------------------------
def _load(model: nn.Module, opened: dict, rename: Callable[[str], str] | None, report: LoadReport) -> None:
    targets = state_dict_targets(model)            # key -> parameter or buffer (tied: several keys)
    sources: dict[str, str] = {}                   # model key -> checkpoint key
    for ckpt_key in opened:
        key = rename(ckpt_key) if rename is not None else ckpt_key
        if key in targets and key not in sources:
            sources[key] = ckpt_key
        else:
            report.unexpected_keys.add(ckpt_key)
    for keys in _tied_groups(targets):
        present = [k for k in keys if k in sources]
        if not present:
            report.missing_keys.update(keys)
            continue
        key = present[0]  # a tied tensor saved under several keys is read once
        ckpt_key, tensor = sources[key], targets[key]
        f = opened[ckpt_key]
        shape = tuple(f.header[ckpt_key]["shape"])
        if shape != tuple(tensor.shape):
            report.mismatched_keys.add((key, shape, tuple(tensor.shape)))
            report.missing_keys.update(k for k in keys if k != key)
            continue
        _load_tensor(key, tensor, f, ckpt_key, report)
        report.loaded_keys.update(keys)


def state_dict_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """model.state_dict(keep_vars=True)'s keys and tensors, in its order, without calling it: an
    engine at stage 3 refuses state_dict (it would gather every weight), and extra-state hooks
    have nothing to load here."""
    out: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for name, p in module._parameters.items():
            if p is not None:
                out[prefix + name] = p
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                out[prefix + name] = b
    return out


def _tied_groups(targets: dict[str, torch.Tensor]) -> list[list[str]]:
    """State-dict keys grouped by the tensor object they name, in state_dict order."""
    groups: dict[int, list[str]] = {}
    for key, t in targets.items():
        groups.setdefault(id(t), []).append(key)
    return list(groups.values())


def _load_tensor(key: str, tensor: torch.Tensor, f, ckpt_key: str, report: LoadReport) -> None:
    unit = unit_of(tensor)
    if unit is None:
        _read_whole(tensor, f, ckpt_key, report)
        return
    _check_construction_unit(key, unit)
    slot = next(s for s in unit.slots if s.param is tensor)
    lo, hi = unit.shard_range
    a = max(slot.offset, lo)
    b = min(slot.offset + slot.numel, hi)
    if a >= b:
        return  # every element of this parameter belongs to other ranks
    if unit.nvme_shard is None:
        _read_range(f, ckpt_key, a - slot.offset, b - slot.offset, unit.shard[a - lo:b - lo], report)
        return
    # zero.Init(remote_device="nvme"): this parameter's piece through host memory to the file
    piece = torch.empty(b - a, dtype=unit.compute_dtype)
    _read_range(f, ckpt_key, a - slot.offset, b - slot.offset, piece, report)
    unit.nvme_shard.home[a - lo:b - lo].copy_(piece)
    unit.nvme_shard.settle()


def _check_construction_unit(key: str, unit: Unit) -> None:
    if unit.group_index != -1:
        raise NotImplementedError(
            f"load_pretrained_sharded: parameter {key!r} belongs to the engine's unit {unit.name!r}; "
            f"load pretrained weights into the model built under zero.Init before initialize() "
            f"(a trained engine restores with load_checkpoint)")
    if unit.state is not WeightState.SHARDED:
        raise RuntimeError(
            f"load_pretrained_sharded: parameter {key!r} is gathered ({unit.state.value}), e.g. inside "
            f"GatheredParameters; load outside it, so that the shard is the only copy written")


def _read_whole(tensor: torch.Tensor, f, ckpt_key: str, report: LoadReport) -> None:
    """A replicated parameter or a buffer: every rank reads all of it."""
    if tensor.numel() > 1 and 0 in tensor.stride():
        raise RuntimeError(
            f"load_pretrained_sharded: {ckpt_key!r} would be written into a released stage-3 "
            f"parameter of shape {tuple(tensor.shape)} that no unit holds any more: the zerokit "
            f"engine that partitioned this model was destroyed or dropped. Load into a model "
            f"built under zero.Init before initialize()")
    with torch.no_grad():
        if tensor.is_contiguous():
            _read_range(f, ckpt_key, 0, tensor.numel(), tensor.data.view(-1), report)
        else:
            whole = torch.empty(tensor.shape, dtype=tensor.dtype)
            _read_range(f, ckpt_key, 0, tensor.numel(), whole.view(-1), report)
            tensor.data.copy_(whole)


def _read_range(f, ckpt_key: str, lo: int, hi: int, out: torch.Tensor, report: LoadReport) -> None:
    """Elements [lo, hi) of the checkpoint tensor into `out` (1-D, contiguous), any dtype/device."""
    from zerokit.checkpoint.storage import DTYPE_OF

    name = f.header[ckpt_key]["dtype"]
    dtype = DTYPE_OF.get(name)
    if dtype is None:
        raise ValueError(f"load_pretrained_sharded: tensor {ckpt_key!r} in {f.path} has dtype {name}; "
                         f"readable: {', '.join(sorted(DTYPE_OF))}")
    nbytes = (hi - lo) * torch.empty((), dtype=dtype).element_size()
    report.bytes_read += nbytes
    report.largest_read = max(report.largest_read, nbytes)
    if out.device.type == "cpu":
        f.read_range(ckpt_key, lo, hi, out)
        return
    staging = torch.empty(hi - lo, dtype=out.dtype)
    f.read_range(ckpt_key, lo, hi, staging)
    out.copy_(staging)


def _check_outcome(report: LoadReport, strict: bool, ignore_mismatched_sizes: bool) -> None:
    if report.mismatched_keys and not ignore_mismatched_sizes:
        shown = "; ".join(f"{k}: checkpoint {list(c)} vs model {list(m)}"
                          for k, c, m in sorted(report.mismatched_keys))
        raise ValueError(f"load_pretrained_sharded: shape mismatch ({shown}); pass "
                         f"ignore_mismatched_sizes=True to leave those as built")
    if strict and (report.missing_keys or report.unexpected_keys):
        raise ValueError(f"load_pretrained_sharded(strict=True): missing keys "
                         f"{sorted(report.missing_keys)}, unexpected keys {sorted(report.unexpected_keys)}")


# ---- measuring ----------------------------------------------------------------------------------
class _RssPeak:
    """RSS growth of this process over a block, at its peak: a thread samples every 2 ms
    (ru_maxrss would report the process's all-time peak, e.g. its imports)."""

    def __enter__(self) -> "_RssPeak":
        self._proc = psutil.Process()
        self._before = self._proc.memory_info().rss
        self._peak = self._before
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.002):
            self._peak = max(self._peak, self._proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self._peak = max(self._peak, self._proc.memory_info().rss)

    @property
    def delta(self) -> int:
        return self._peak - self._before


def _log_on_rank0(report: LoadReport) -> None:
    import torch.distributed as dist

    from zerokit.logs import configure_logging, log

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    configure_logging(rank)
    if rank == 0:
        log.info("zerokit pretrained load (rank 0): %s", report.summary())
