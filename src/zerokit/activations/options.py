"""The settings `checkpoint` reads: DeepSpeed's `configure` and its module-level state.

DeepSpeed's activation checkpointing is configured once per process (`configure(mpu_, ...)`),
not per model: Megatron-style code calls `deepspeed.checkpointing.configure(mpu, deepspeed_config=
...)` and then `checkpoint(fn, *args)` anywhere. zerokit keeps that shape, with the state in one
object (`SETTINGS`) instead of a dozen globals.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch.distributed as dist

from zerokit.tiers.ledger import Ledger

log = logging.getLogger("zerokit")


@dataclass(frozen=True)
class Options:
    """The `activation_checkpointing` section, in its config key names (see config/schema.py)."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    def check(self) -> "Options":
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise ValueError("contiguous_checkpointing=True (contiguous_memory_optimization) needs "
                             "num_checkpoints (number_checkpoints): how many checkpoints one forward "
                             "makes, the slots of the preallocated buffers")
        if self.number_checkpoints is not None and self.number_checkpoints <= 0:
            raise ValueError(f"num_checkpoints (number_checkpoints) must be > 0 "
                             f"(got {self.number_checkpoints})")
        return self


@dataclass(frozen=True)
class ModelParallel:
    """The model-parallel group whose ranks hold identical copies of an activation."""

    group: Any = None
    rank: int = 0
    size: int = 1

    @staticmethod
    def from_mpu(mpu: Any) -> "ModelParallel":
        """Megatron's names; the tensor-parallel ones first, as DeepSpeed reads them."""
        for prefix in ("get_tensor_model_parallel_", "get_model_parallel_"):
            if hasattr(mpu, prefix + "rank"):
                return ModelParallel(getattr(mpu, prefix + "group")(), getattr(mpu, prefix + "rank")(),
                                     getattr(mpu, prefix + "world_size")())
        raise TypeError(f"mpu_ must have get_model_parallel_group/rank/world_size (or the "
                        f"get_tensor_model_parallel_* names); got {type(mpu).__name__}")


@dataclass
class Settings:
    options: Options = field(default_factory=Options)
    mp: ModelParallel = field(default_factory=ModelParallel)
    mpu: Any = None
    configured: bool = False
    ledger: Ledger = field(default_factory=Ledger)
    timings: dict[str, float] = field(default_factory=lambda: {"forward": 0.0, "backward": 0.0})


SETTINGS = Settings()


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """DeepSpeed's `deepspeed.checkpointing.configure`: defaults, then the config's
    `activation_checkpointing` section (a dict, a JSON path or a ZeroKitConfig), then each
    argument given. An mpu_ given once is kept by later calls that pass none (as DeepSpeed)."""
    from zerokit.activations.store import STORE

    mpu = mpu_ if mpu_ is not None else SETTINGS.mpu
    mp = ModelParallel.from_mpu(mpu) if mpu is not None else ModelParallel()
    opts = Options() if deepspeed_config is None else _section(deepspeed_config)
    given = {"partition_activations": partition_activations,
             "contiguous_memory_optimization": contiguous_checkpointing,
             "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
             "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    opts = replace(opts, **{k: v for k, v in given.items() if v is not None}).check()
    SETTINGS.options, SETTINGS.mpu, SETTINGS.mp = opts, mpu, mp
    SETTINGS.configured = True
    STORE.reset()
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info("zerokit activation checkpointing: %s, model-parallel size %d", opts, SETTINGS.mp.size)


def _section(config: Any) -> Options:
    from zerokit.config import load_config

    section = load_config(config).activation_checkpointing
    return Options(**section.model_dump())


def is_configured() -> bool:
    """True once configure() ran (DeepSpeed's meaning); checkpoint() works either way."""
    return SETTINGS.configured


def use_ledger(ledger: Ledger) -> None:
    """Count activation bytes in this ledger (an engine's) from now on."""
    SETTINGS.ledger = ledger


def timings() -> dict[str, float]:
    """Seconds spent in checkpoints' forward and backward since configure (profile=True)."""
    return dict(SETTINGS.timings)
