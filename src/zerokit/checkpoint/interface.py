"""What a checkpoint asks of the thing it saves: named state pieces and a few scalars.

[Note: checkpoint interface]
The checkpoint package knows the file format, the resharding arithmetic and the commit protocol;
it knows nothing of units, optimizer parts, executors or tiers, and it imports no engine. The
engine offers (engine/checkpoint_state.py implements `Checkpointable`):
- `checkpoint_units()`: every unit's geometry as plain records (`UnitRecord`): name, sizes,
  each parameter's name / shape / offset. meta.json describes these, and loading maps a saved
  parameter range onto them.
- `state_to_save()`: this rank's saved range of every unit as `SavePiece`s, one per tensor of
  the rank file (`{unit}/master`, `{unit}/optim.{key}`, `{unit}/weights`, ...), each an ordered
  list of segments that are views of the live state: a tensor (device or host), or a
  `FileRange` (io/file_range.py: state resident in a file, the NVMe tier's own ranges). The
  segments are written one after the other, never concatenated in memory; a file range is
  copied file to file. Plus the optimizer's per-unit state keys and scalars, and the host
  executor's position (`HostRecord`).
- `restore_state(fill, optimizer)`: the engine walks its own state in the order it needs it
  (masters first, so weight gathers overlap the rest of the reads) and calls `fill(piece)` for
  each `LoadPiece`: elements [lo, hi) of a unit's flat index space, of a saved kind, into a
  target (a tensor or a `FileRange`). The checkpoint resolves which saved files hold them.
- `training_scalars()` / `restore_training_scalars(...)`: step counters, loss scaler, LR
  scheduler, optimizer param groups.
- `save_lease` (units/lease.py): an asynchronous save runs on it; the engine's step, and edits
  through GatheredParameters, settle it before changing bytes the save still reads.
- the public `comm`, `module`, `config`, `training_dataloader`, `global_steps`, `micro_steps`,
  `gradient_accumulation_steps()` and `wait_for_weights()`.
Client state is the caller's, passed to save and returned by load.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from zerokit.io.file_range import FileRange  # the nvme tier's own ranges (tiers/nvme.py)


# One run of elements of a saved tensor: a view of live state, or a range of a file.
Segment = "torch.Tensor | FileRange"


def segment_numel(s: "torch.Tensor | FileRange") -> int:
    """Elements of a segment or load target (a FileRange's `numel` is a field, a tensor's a method)."""
    return s.numel if isinstance(s, FileRange) else s.numel()


def segment_nbytes(s: "torch.Tensor | FileRange") -> int:
    return s.nbytes if isinstance(s, FileRange) else s.numel() * s.element_size()


@dataclass(frozen=True)
class SavePiece:
    """One tensor of a rank file: `name` (`{unit}/{kind}`), as consecutive segments."""

    name: str
    segments: tuple  # of Segment, in element order; never concatenated in memory


@dataclass(frozen=True)
class ParamRecord:
    fqn: str
    shape: tuple[int, ...]
    offset: int  # first element in its unit's flat index space
    numel: int


@dataclass(frozen=True)
class UnitRecord:
    """A unit's geometry (see [Note: unit layout] in units/unit.py), as a checkpoint sees it."""

    name: str
    numel: int
    padded_numel: int
    shard_numel: int
    trainable: bool
    group_index: int
    compute_dtype: torch.dtype
    params: tuple[ParamRecord, ...]
    # the saved master's dtype: bf16 with bf16.bf16_master_weights_and_grads (engine/bf16_state.py);
    # a checkpoint loads into either, converted (bf16 -> fp32 exactly, fp32 -> bf16 rounded once)
    master_dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class LoadPiece:
    """Elements [lo, hi) of `unit`'s flat index space, of the saved `kind` ("values": the master,
    or a frozen unit's weights; "optim.{key}"; "weights_in_use"), into `target` (hi - lo
    elements). Elements no loaded parameter covers keep their value, or become 0 with zero_rest."""

    unit: UnitRecord
    kind: str
    lo: int
    hi: int
    target: "torch.Tensor | FileRange"
    zero_rest: bool = False


@dataclass(frozen=True)
class HostRecord:
    """The host optimizer executor's position (see [Note: host step counts] and [Note: delayed
    update in checkpoints] in engine/checkpoint_state.py)."""

    host_steps: dict[str, int]      # unit name -> host updates applied to its host part
    launches: int
    pending_write_back: bool


@dataclass(frozen=True)
class SaveState:
    pieces: list[SavePiece]
    optim_keys: dict[str, list[str]]           # unit -> state tensors shaped like the master
    optim_scalars: dict[str, dict[str, Any]]   # unit -> the rest of torch's state (`step`)
    host: HostRecord | None                    # None: no host executor


@dataclass(frozen=True)
class SavedUnitOptimizer:
    """What a checkpoint holds for one of this engine's units' optimizer state."""

    keys: tuple[str, ...]       # empty: saved before any step
    scalars: dict[str, Any]
    host_steps: int | None      # None: saved without a host part; use torch's `step`


@dataclass(frozen=True)
class SavedOptimizer:
    param_groups: list[dict]
    units: dict[str, SavedUnitOptimizer] = field(default_factory=dict)  # this engine's unit names
    launches: int = 0                       # host executor launches to continue from
    pending_write_back: bool = False        # saved with a delayed host update pending


Fill = Callable[[LoadPiece], None]


class Checkpointable(Protocol):
    """The narrow interface of [Note: checkpoint interface]; zerokit's Engine implements it."""

    comm: Any
    module: torch.nn.Module
    config: Any
    training_dataloader: Any
    save_lease: Any
    global_steps: int
    micro_steps: int

    def gradient_accumulation_steps(self) -> int: ...

    def wait_for_weights(self) -> None: ...

    def checkpoint_units(self) -> list[UnitRecord]: ...

    def state_to_save(self) -> SaveState: ...

    def restore_state(self, fill: Fill, optimizer: SavedOptimizer | None) -> None: ...

    def training_scalars(self) -> dict[str, Any]: ...

    def restore_training_scalars(self, scalars: dict[str, Any], *, optimizer: bool,
                                 lr_scheduler: bool) -> None: ...
