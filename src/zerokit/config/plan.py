"""The start-up plan: what is partitioned, what lives where, and the bytes per tier on this rank.

Logged by rank 0 at `initialize` (report_startup), so that a user sees the effective configuration (after
defaults and the batch-size rule) and the memory it implies before the first step runs.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from zerokit.config.ignored import format_ignored, ignored_settings
from zerokit.logs import log
from zerokit.policy.layout import gradient_refill_bytes
from zerokit.sizes import mib
from zerokit.tier_names import TierName

if TYPE_CHECKING:  # described through its public attributes; importing this imports no engine
    from zerokit.engine.engine import Engine

# Bytes of optimizer state per master element, for the start-up plan (before state exists).
STATE_BYTES_PER_ELEMENT = {"Adam": 8, "AdamW": 8, "SGD": 4, "Adagrad": 4, "HostLion": 4, "Lion": 4,
                           "HostAdam": 8, "HostAdagrad": 4}


def report_startup(engine: "Engine") -> None:
    """Rank 0, once per initialize, through the "zerokit" logger (see logs.py): the config
    keys accepted and ignored (a warning, with each reason), then the plan."""
    if engine.comm.rank != 0:
        return
    found = ignored_settings(engine.config)
    if found:
        log.warning(format_ignored(found))
    if engine.config.renamed:
        log.warning("config keys under DeepSpeed's deprecated names, read as the current ones: "
                    + ", ".join(engine.config.renamed))
    if log.isEnabledFor(logging.INFO):
        log.info(explain(engine))


def explain(engine: "Engine") -> str:
    cfg, comm, ledger = engine.config, engine.comm, engine.ledger
    units = engine.units
    trainable = sum(u.numel for u in units if u.trainable)
    frozen = sum(u.numel for u in units if not u.trainable)
    masters = sum(u.opt_range[1] - u.opt_range[0] for u in units if u.trainable)
    opt_name = type(engine.optimizer).__name__
    placement = getattr(engine, "placement", None)
    master, state = _storage_names(placement)
    per_elem = STATE_BYTES_PER_ELEMENT.get(opt_name)
    if per_elem and state == "bf16":
        per_elem //= 2  # the table counts fp32 state
    state_now = ledger.bytes(kind="optimizer_state")
    state_line = (f"{mib(state_now)} (measured)" if state_now else
                  f"~{mib(per_elem * masters)} ({per_elem} B x {masters:,} master elements, "
                  f"allocated at the first step)" if per_elem else "allocated at the first step")
    largest = max(units, key=lambda u: u.numel)
    lines = [
        "zerokit plan",
        f"  world: {comm.world_size} rank(s), backend {comm.backend}, device {comm.device}",
        f"  {engine.policy.describe()}",
        f"  precision: compute {cfg.compute_dtype_name}, master {master}, optimizer state {state}"
        + (" (bf16.stochastic_rounding)" if placement is not None and placement.stochastic_rounding
           else "") + ", gradient reduction "
        f"{str(units[0].reduce_dtype).replace('torch.', '')}"
        + (f", loss scale {engine.loss_scaler.scale:g} ({'dynamic' if engine.loss_scaler.dynamic else 'static'})"
           if cfg.fp16.enabled else "")
        + (", floating inputs cast to fp16 (fp16.auto_cast)" if cfg.fp16.auto_cast else ""),
        f"  batch: {engine.train_batch_size()} = micro {engine.train_micro_batch_size_per_gpu()} x accumulation "
        f"{engine.gradient_accumulation_steps()} x world {comm.world_size}",
        f"  parameters: {trainable:,} trainable, {frozen:,} frozen, in {len(units)} units "
        f"(largest: {largest.name}, {largest.numel:,})",
        f"  optimizer: {opt_name} over {masters:,} {master} master elements on this rank; state {state_line}",
        f"  gradient clipping: {cfg.gradient_clipping or 'off'}; reduce buckets of "
        f"{cfg.zero_optimization.reduce_bucket_size:,} elements, "
        + ("overlapping backward" if cfg.zero_optimization.overlap_comm else
           "each waited for as it starts (overlap_comm: false)"),
        *_offload_lines(engine),
        ledger.format(f"  bytes on rank {comm.rank} (before the first step)"),
    ]
    return "\n".join(lines)


def _storage_names(placement) -> tuple[str, str]:
    """(master dtype, state dtype) as the plan prints them (bf16.bf16_master_weights_and_grads,
    bf16.bf16_optimizer_states: engine/bf16_state.py)."""
    if placement is None:
        return "fp32", "fp32"
    return _DTYPE_NAMES[placement.master_dtype], _DTYPE_NAMES[placement.state_dtype]


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _offload_lines(engine: "Engine") -> list[str]:
    placement = getattr(engine, "placement", None)
    if placement is None:
        return []
    lines = (_offload_param_lines(engine, placement)
             if placement.params_on_host or placement.params_on_nvme else [])
    if not placement.offloads:
        return lines
    host = sum(u.host_numel for u in engine.units)
    total = sum(u.opt_range[1] - u.opt_range[0] for u in engine.units if u.trainable)
    moved = sum(engine.ledger.bytes(tier=TierName.HOST, kind=k) for k in ("master", "grads", "optimizer_state"))
    lines += [
        f"  {placement.describe()}",
        f"    {host:,} of {total:,} optimizer elements on the host on rank {engine.comm.rank}: "
        f"{mib(moved)} allocated there (master + optimizer state + gradients of the offloaded "
        f"part)"]
    return lines + _nvme_lines(engine, total) + _speculation_lines(engine, placement)


def _speculation_lines(engine: "Engine", placement) -> list[str]:
    """offload_optimizer.step_in_backward: on or off, and what its rollbacks cost (see [Note:
    the speculative step] in parts/speculation.py)."""
    if not placement.step_in_backward:
        return ["    speculative step in backward: off (offload_optimizer.step_in_backward)"]
    grad = torch.empty(0, dtype=placement.gradient_dtype).element_size()  # held in its dtype
    held = grad * sum(u.host_numel + u.layout.nvme_numel for u in engine.units if u.trainable)
    return [f"    speculative step in backward: on; restores "
            f"{mib(engine.ledger.bytes(tier=TierName.HOST, kind='restores'))} host (a copy of the "
            f"host parts' master + state + 16-bit output), "
            f"{mib(engine.ledger.bytes(tier=TierName.NVME, kind='restores'))} nvme (a second file "
            f"slot of master + state); gradients held in host memory until the step decides "
            f"{mib(held)}; speculation "
            f"{engine.config.zero_optimization.offload_optimizer.speculation} (adaptive: not "
            f"after a step whose clipping applied)"]


def _nvme_lines(engine: "Engine", total: int) -> list[str]:
    """ZeRO-Infinity's optimizer: elements and bytes on NVMe, the NVMe traffic one step expects."""
    nvme = sum(u.layout.nvme_numel for u in engine.units)
    if not nvme:
        return []
    grads = engine.ledger.bytes(tier=TierName.NVME, kind="grads")  # none where held in RAM
    on_disk = grads + sum(engine.ledger.bytes(tier=TierName.NVME, kind=k) for k in ("master", "optimizer_state"))
    placement = getattr(engine, "placement", None)
    master, state = _storage_names(placement)
    grad = _DTYPE_NAMES[placement.gradient_dtype] if placement is not None else master
    again = gradient_refill_bytes([u.layout for u in engine.units])  # accumulation's refills
    return [f"    {nvme:,} of {total:,} optimizer elements on NVMe on rank {engine.comm.rank}: "
            f"{mib(on_disk)} in files ({master} master, {f'{grad} gradient, ' if grads else ''}"
            f"{state} optimizer state); "
            f"expected NVMe traffic per step {mib(2 * (on_disk + again))} (each read once and "
            f"written once" + (", the gradients once more each way per micro-step after the "
                               "first)" if again else ")")]


def _offload_param_lines(engine: "Engine", placement) -> list[str]:
    shards = [u for u in engine.units if u.shard is not None and u.nvme_shard is None]
    files = [u for u in engine.units if u.nvme_shard is not None]
    nbytes = engine.ledger.bytes(tier=TierName.HOST, kind="weights")
    lines = [f"  {placement.describe_params()}"]
    if shards or not files:
        lines.append(f"    {len(shards)} weight shards on the host on rank {engine.comm.rank}: "
                     f"{mib(nbytes)} left the device (weights are there only while gathered; the "
                     f"master is where offload_optimizer puts it)")
    if files:
        on_disk = sum(u.nvme_shard.file.nbytes for u in files)
        micro = engine.gradient_accumulation_steps()
        lines.append(f"    {len(files)} weight shards on NVMe on rank {engine.comm.rank}: "
                     f"{mib(on_disk)} in files; expected weight traffic per step: read "
                     f"{mib(2 * micro * on_disk)} (each shard once per gather, forward and "
                     f"backward of {micro} micro-step(s)), written {mib(on_disk)} (once)")
    return lines
