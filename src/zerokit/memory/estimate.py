"""Bytes per rank per tier for a model and a config, without allocating the model.

[Note: the estimator's byte rules]
The estimate is the engine's own plan, run on a model that lives on the meta device:
- the units are the engine's (units/wrap.py), their buffers the engine's layout records
  (engine/byte_plan.py `plan_layouts` -> policy/layout.py `plan_layout`);
- the model states per tier and kind are engine/byte_plan.py `planned_bytes`, the rules the
  start-up checks and the placement planner (engine/planner.py) read too: host bytes are
  `planned_host_need` (the host records, the host parts' optimizer state, the NVMe stream's
  buffer sets, the shards read ahead, the held gradients' pool); device optimizer state is
  STATE_BYTES_PER_ELEMENT (config/plan.py) per device-part element, nvme optimizer state the
  same per nvme-part element (engine/nvme_plan.py's rule), halved with bf16.bf16_optimizer_states;
  masters and gradients follow the placement's dtypes (engine/bf16_state.py `with_state_dtypes`,
  as at initialize);
- stage 3's gathered weights are the real scheduler's peak over the model's use order
  (engine/gathered_peak.py), and the reduction's gradient buffers those units/reduction.py
  `launch_reduce` allocates (byte_plan.py `reduce_buffer_bytes`: as many alive as the engine
  lets be in flight);
- activations are the bytes one micro-batch's forward saves for backward, measured on the meta
  device (memory/activations.py). The ledger counts activations only when zerokit's activation
  checkpointing keeps them, so the per-tier comparison with a run's ledger leaves them out.
Every rank's shards are padded to one size, so the figure is the same on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from zerokit.config import load_config, resolve_auto
from zerokit.engine.byte_plan import plan_layouts, planned_bytes, reduce_buffer_bytes
from zerokit.engine.gathered_peak import gathered_peak_numel
from zerokit.engine.bf16_state import with_state_dtypes
from zerokit.engine.precision import compute_dtype, reduce_dtype, with_gradient_dtype
from zerokit.memory.activations import measure_forward, token_batch
from zerokit.memory.sources import source_of
from zerokit.optim.recipe import recipe_from
from zerokit.policy import PartitionPolicy, PlacementPolicy
from zerokit.tier_names import TierName
from zerokit.units.wrap import group_parameters, select_modules

_DEFAULT_OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-4}}


@dataclass
class Estimate:
    """Peak bytes on one rank, per tier and ledger kind, for one config."""

    label: str
    world_size: int
    params: int
    bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # tier -> kind -> bytes
    activation_note: str = ""

    def tier(self, tier: str, activations: bool = True) -> int:
        return sum(v for k, v in self.bytes[TierName(tier)].items()
                   if activations or k != "activations")

    def table(self) -> dict[str, dict[str, int]]:
        return {str(t.value): dict(kinds) for t, kinds in self.bytes.items()}


def estimate(model: Any, world_size: int = 1, config: dict | None = None, *, stage: int | None = None,
             offload_optimizer: str | None = None, offload_param: str | None = None,
             dtype: str | None = None, micro_batch: int | None = None, seq_len: int | None = None,
             cuda: bool = True, wrap: Any = None, inputs: dict | None = None,
             activations: bool = True, nvme_path: str = "/local_nvme") -> Estimate:
    """Bytes per rank per tier (device, host, nvme) that training `model` under `config` on
    `world_size` ranks allocates, activations of one micro-batch included; nothing is allocated.

    model: an nn.Module, a transformers PretrainedConfig (or a local model's name), a
    zerokit.models.GPTConfig, or a built-in shape ("demo", "gpt-125m", "gpt-1b", "gpt-3b").
    config: a DeepSpeed-style dict (as initialize takes); the keyword arguments override it:
    stage, offload_optimizer / offload_param ("none", "cpu", "nvme"), dtype ("fp32", "bf16",
    "fp16"), micro_batch. seq_len: tokens per sample for the activations (default: the model's
    longest). cuda: the compute device is a GPU (host buffers that cross are pinned, gradients
    land in a staging buffer), as the engine plans it. inputs: the forward's keyword arguments
    (meta tensors) for a model that is not a language model; activations=False: model states
    only (no forward runs; stage 3's use order is then the units' order).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (got {world_size!r})")
    src = source_of(model)
    cfg = resolve_auto(load_config(_config(config, stage, offload_optimizer, offload_param, dtype,
                                           micro_batch, nvme_path)), src.model)
    zero = cfg.zero_optimization
    placement = PlacementPolicy.from_config(zero)
    if placement.auto:
        raise ValueError("offload_optimizer.ratio 'auto' is chosen at initialize from rates measured "
                         "on the machine; give a number in [0, 1] to estimate")
    placement = with_state_dtypes(cfg, placement, None)  # bf16 master / state keys
    _, micro, accumulation = cfg.resolve_batch(world_size)
    placement = with_gradient_dtype(cfg, placement, world_size, accumulation)
    policy = PartitionPolicy.for_stage(zero.stage).for_accumulation(accumulation)
    recipe = recipe_from(src.model, None, None, cfg.optimizer)
    groups = group_parameters(src.model, select_modules(src.model, wrap), recipe.group_of)
    compute = compute_dtype(cfg)
    layouts = plan_layouts(groups, world_size, 0, cuda, policy, compute, reduce_dtype(cfg),
                           accumulation, placement)
    result = Estimate(_label(zero), world_size, sum(lay.numel for lay in layouts),
                      planned_bytes(cfg, placement, layouts, recipe.kind))
    device = result.bytes[TierName.DEVICE]

    modules = [module for _, module, *_ in groups]
    saved, order = (_activations(src, inputs, micro, seq_len, compute, modules, result)
                    if activations else (0, []))
    device["activations"] += saved
    element = torch.empty(0, dtype=compute).element_size()
    if policy.shard_weights:
        units = [(name, module, lay.numel, lay.padded_numel)
                 for (name, module, *_), lay in zip(groups, layouts) if lay.gathers]
        device["weights"] += element * gathered_peak_numel(units, order or modules, src.model, zero)
    device["buffers"] += reduce_buffer_bytes(layouts, policy, compute, reduce_dtype(cfg), zero,
                                             world_size)
    return result


def _activations(src, inputs, micro: int, seq_len: int | None, compute: torch.dtype, modules,
                 result: Estimate) -> tuple[int, list]:
    if inputs is None and src.vocab is None:
        result.activation_note = ("activations not measured: pass inputs= (the forward's keyword "
                                  "arguments as meta tensors) for a model that is not a language model")
        return 0, []
    seq = seq_len or src.max_seq
    if inputs is None and not seq:
        raise ValueError(f"{src.label}: its longest sequence is not in its config; pass seq_len=")
    batch = inputs if inputs is not None else token_batch(src.vocab, micro, seq, src.hf)
    saved, order = measure_forward(src.model, batch, compute, modules)
    result.activation_note = (f"activations: one micro-batch ({micro} x {seq} tokens), saved for "
                              f"backward, measured on the meta device" if inputs is None else
                              "activations: the given inputs' forward, measured on the meta device")
    return saved, order


def _config(config: dict | None, stage, offload_optimizer, offload_param, dtype, micro_batch,
            nvme_path: str) -> dict:
    cfg = dict(config or {})
    cfg.setdefault("optimizer", _DEFAULT_OPTIMIZER)
    if micro_batch is not None or not any(k in cfg for k in ("train_batch_size",
                                                              "train_micro_batch_size_per_gpu")):
        cfg["train_micro_batch_size_per_gpu"] = micro_batch or 1
    zero = dict(cfg.get("zero_optimization", {}))
    if stage is not None:
        zero["stage"] = stage
    for key, device in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if device is None:
            continue
        if device not in ("none", "cpu", "nvme"):
            raise ValueError(f"{key} must be 'none', 'cpu' or 'nvme' (got {device!r})")
        section = dict(zero.get(key, {}))
        section["device"] = device
        if device == "nvme":
            section.setdefault("nvme_path", nvme_path)
        zero[key] = section
    cfg["zero_optimization"] = zero
    if dtype is not None:
        if dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"dtype must be 'fp32', 'bf16' or 'fp16' (got {dtype!r})")
        # bf16's other keys (bf16_master_weights_and_grads, ...) stay where bf16 is on
        cfg["bf16"] = {**cfg.get("bf16", {}), "enabled": True} if dtype == "bf16" else {"enabled": False}
        cfg["fp16"] = {"enabled": dtype == "fp16"}
    return cfg


def _label(zero) -> str:
    parts = [f"stage {zero.stage}"]
    if zero.offload_optimizer.device != "none":
        parts.append(f"optimizer {zero.offload_optimizer.device}")
    if zero.offload_param.device != "none":
        parts.append(f"params {zero.offload_param.device}")
    return ", ".join(parts)


def choices() -> list[dict]:
    """Every stage and offload choice the estimator's grid covers (the `zerokit estimate` rows)."""
    rows = [{"stage": s, "offload_optimizer": "none", "offload_param": "none"} for s in range(4)]
    for s in (1, 2, 3):
        for device in ("cpu", "nvme"):
            rows.append({"stage": s, "offload_optimizer": device, "offload_param": "none"})
    for device in ("cpu", "nvme"):
        rows.append({"stage": 3, "offload_optimizer": device, "offload_param": device})
    return rows


def estimate_grid(model: Any, world_size: int = 1, **kwargs) -> list[Estimate]:
    """estimate() for each of `choices()`; keyword arguments as estimate's."""
    src = source_of(model)  # built once on meta, shared by the rows
    kwargs = {k: v for k, v in kwargs.items() if k not in ("stage", "offload_optimizer", "offload_param")}
    return [estimate(src.model, world_size, **row, **kwargs) for row in choices()]

