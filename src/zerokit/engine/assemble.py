"""From (model, optimizer choice, config) to a ready Engine: the steps of `zerokit.initialize`."""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, Iterable

import torch
import torch.nn as nn

from zerokit.config import load_config, resolve_auto
from zerokit.config.schema import ZeroKitConfig, parse_size
from zerokit.config.plan import report_startup
from zerokit.comm.collectives import Comm
from zerokit.comm.devices import model_device_of
from zerokit.units.leaf import leaf_parameter_ids
from zerokit.units.ds_attributes import attach_ds_views
from zerokit.policy.layout import UnitLayout
from zerokit.units.reduction import bucket_numel
from zerokit.units.unit import Unit
from zerokit.units.wrap import group_parameters, select_modules
from zerokit.engine.deepspeed_api import config_dict
from zerokit.engine.engine import Engine
from zerokit.parts.executors import DeviceExecutor, HostExecutor
from zerokit.engine import bf16_state, host_budget, nvme_plan, planner, planner_at_init
from zerokit.parts.nvme_executor import NvmeExecutor
from zerokit.engine.byte_plan import (gradient_file_io, gradient_write_bytes, plan_layouts,
                                     planned_host_need, reduce_buffer_bytes, stream_settings)
from zerokit.optim.recipe import build_optimizer, recipe_from
from zerokit.engine.precision import compute_dtype, reduce_dtype, with_gradient_dtype
from zerokit.engine.lr_schedules import build_scheduler
from zerokit.policy import PartitionPolicy, PlacementPolicy
from zerokit.tiers import Ledger
from zerokit.tiers.host_release import release_free_host_memory
from zerokit.tier_names import TierName
from zerokit.tiers.nvme import NvmeTier
from zerokit.logs import configure_logging
from zerokit.zero import (adopt_constructed, constructed_host_bytes, constructed_nvme_files,
                          retire_constructed, retire_laid_out)


def initialize(model: nn.Module, optimizer: Any = None,
               model_parameters: Iterable[Any] | None = None, config: Any = None,
               lr_scheduler: Any = None, training_data: Any = None, collate_fn: Any = None,
               wrap: Any = None, config_params: Any = None):
    """DeepSpeed's initialize: returns (engine, optimizer, dataloader, lr_scheduler).

    wrap: module classes (or a predicate (name, module) -> bool) that become units; by default
    every block of the model's nn.ModuleLists.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (got {type(model).__name__})")
    cfg = resolve_auto(load_config(config if config is not None else config_params), model)
    # Before anything allocates: under a launcher each rank's GPU is its LOCAL_RANK; alone on a
    # CUDA machine, the GPU the model is on (else cuda:0); see comm/devices.py.
    comm = Comm.from_environment(cfg.comm_timeout_s, model_device_of(model))
    configure_logging(comm.rank)
    batch = cfg.resolve_batch(comm.world_size)
    policy = PartitionPolicy.for_stage(cfg.zero_optimization.stage).for_accumulation(batch[2])
    recipe = recipe_from(model, optimizer, model_parameters, cfg.optimizer)

    dtype = compute_dtype(cfg)
    if comm.device.type != "cpu":
        model.to(comm.device)
    for buf in model.buffers():  # as DeepSpeed's module.half()/bfloat16(): float buffers follow
        if buf.is_floating_point():
            buf.data = buf.data.to(dtype)
    ledger = Ledger()
    budgets = host_budget.budgets(cfg)  # enforced from the first allocation on ([Note: budgets])
    for tier, (nbytes, source) in budgets.items():
        ledger.set_budget(tier, nbytes, source)
    groups = group_parameters(model, select_modules(model, wrap), recipe.group_of)
    placed = None
    if planner.asked(cfg, budgets):  # budgets in, placement out: the chosen keys fill the config
        placed = planner_at_init.plan_at_initialize(planner.PlanInputs(
            cfg, groups, comm.world_size, comm.rank, comm.device.type == "cuda", policy, dtype,
            reduce_dtype(cfg), batch[2], recipe.kind, optimizer, budgets,
            rss_margin=parse_size(cfg.memory.rss_margin, "memory.rss_margin")), model, comm)
        cfg = placed.config
    placement = PlacementPolicy.from_config(cfg.zero_optimization)
    plan = functools.partial(plan_layouts, groups, comm.world_size, comm.rank,
                             comm.device.type == "cuda", policy, dtype, reduce_dtype(cfg), batch[2])
    # bf16 master / state (their bytes are what "auto" weighs, and everything below counts)
    placement = bf16_state.with_state_dtypes(cfg, placement, optimizer)
    placement = with_gradient_dtype(cfg, placement, comm.world_size, batch[2])
    if placement.auto:
        placement = _auto_ratio(placement, plan, comm.device, dtype)
    # Where every byte goes is decided here, before anything is allocated: a plan the host
    # cannot hold is refused with the numbers (engine/host_budget.py).
    avail, source = host_budget.available_host_bytes()
    freed = constructed_host_bytes(model)  # zero.Init's shards, freed as the units are laid out
    if freed:
        avail, source = avail + freed, f"{source}, with the {host_budget.size(freed)} of zero.Init shards initialize frees"
    if TierName.HOST in budgets and budgets[TierName.HOST][0] < avail // host_budget.local_ranks():
        # a host budget below what the machine has: the plan is refused against the budget, per rank
        avail = budgets[TierName.HOST][0] * host_budget.local_ranks()
        source = f"{budgets[TierName.HOST][1]}, {host_budget.size(budgets[TierName.HOST][0])} per rank"
    if placement.step_in_backward and not _speculation_fits(cfg, placement, plan(placement),
                                                            recipe.kind, avail, comm.rank):
        placement = dataclasses.replace(placement, step_in_backward=False)
    layouts = plan(placement)
    # idle scratch buffers (tiers/scratch.py): no more than the plan counts for the reductions in
    # flight and the gradient writes, whose bytes every plan (and a budget's) holds for the whole
    # step
    ledger.scratch.idle_limit = (
        reduce_buffer_bytes(layouts, policy, dtype, reduce_dtype(cfg), cfg.zero_optimization,
                            comm.world_size)
        + gradient_write_bytes(layouts))
    need = planned_host_need(cfg, placement, layouts, recipe.kind)
    on_nvme = _check_nvme(cfg, placement, layouts, recipe.kind, constructed_nvme_files(model))
    host_budget.check_host_memory(need, placement, available=(avail, source))
    # one tier (one I/O engine, one count) whose weight shards go to offload_param's path
    nvme = NvmeTier(ledger, on_nvme[0], rank=comm.rank, config=cfg.aio.engine_config(),
                    weights_directory=on_nvme[-1]) if on_nvme else None
    gradient_io = gradient_file_io(layouts)
    if nvme is not None and gradient_io is not None:
        gradient_io.apply(nvme)
    # Before the layout allocates (after the planner read the untrimmed RSS it reserves from,
    # engine/planner_at_init.py): what building the model freed is still resident in the heap.
    # At 1B built under zero.Init it was 2.0 GiB, and the layout's 2.6 GiB stacked on it: setup
    # peaked at 5.26 GiB against a 5.69 GiB budget whose steps peaked at 4.57.
    release_free_host_memory("initialize, before the layout")
    buckets = bucket_numel(cfg.zero_optimization.reduce_bucket_size, comm.world_size, placement)
    trimmed = 0  # zero.Init's gathered weights, handed back unit by unit (below)
    units = []
    gathered: list[Unit] = []  # construction units gathered for a unit, some parameters not yet laid out
    for (name, module, group, trainable, params), layout in zip(groups, layouts):
        # Weights built under zero.Init are sharded per module: gather them (one unit's worth)
        # to lay them out as this unit, then free the construction shards once every parameter
        # they hold is laid out (a module's weight and bias may go to units of two optimizer
        # groups: freeing at the first left the bias a view of freed memory, which the second
        # unit's broadcast sent: gloo's "writev: Bad address").
        gathered += [u for u in adopt_constructed(model, [p for _, p in params]) if u not in gathered]
        units.append(Unit(name, params, module=module, trainable=trainable, group_index=group,
                          comm=comm, policy=policy, compute_dtype=dtype,
                          reduce_dtype=reduce_dtype(cfg),
                          bucket_numel=buckets, ledger=ledger,
                          grad_accum_steps=batch[2], layout=layout, nvme=nvme))
        still = retire_laid_out(gathered)
        if len(still) < len(gathered):
            # The retired construction units' gathered weights went to the heap (pieces under
            # glibc's mmap threshold): handed back now, they do not stack up under the next
            # units' layout (at 1B: 1.4 GiB by the end of the loop).
            trimmed += release_free_host_memory("initialize", quiet=True)
        gathered = still
    if trimmed >= 64 << 20:
        logging.getLogger("zerokit").info(
            "initialize: returned %.0f MiB of zero.Init's gathered weights to the OS, unit by unit",
            trimmed / 2**20)
    retire_constructed(model)
    leaf_params = leaf_parameter_ids(model)
    for index, unit in enumerate(units):
        unit.index = index
        unit.grad_scales = cfg.gradient_reduction_scales(comm.world_size)
        unit.reduce_at_end = any(id(s.param) in leaf_params for s in unit.slots)
        unit.sanity_checks = cfg.zero_optimization.enable_sanity_checks  # zero.GatheredParameters
    comm.unit_names = [u.name for u in units]  # divergence errors name the other rank's unit
    comm.unit_params = [u.param_fqns() for u in units]  # ... and its parameters
    # torch's optimizer steps only the device parts; the host executor steps the host parts.
    masters = [[u.master for u in units if u.trainable and u.group_index == g]
               for g in range(len(recipe.hyper))]
    torch_optimizer = build_optimizer(recipe, masters)
    scheduler = _scheduler(cfg, lr_scheduler, torch_optimizer, optimizer)
    bf16_state.configure_parts(units, placement)  # before the executors allocate the state
    executors = _executors(units, placement, torch_optimizer, ledger)
    if any(p.tier is TierName.NVME for u in units for p in u.parts):  # after the host executor (its
        # worker overlaps the stream), before torch
        executors.insert(-1, _nvme_executor(cfg, units, nvme, torch_optimizer, ledger, placement))
    if placement.step_in_backward:
        _enable_speculation(executors)
    _count_held_gradients(executors, ledger)
    engine = Engine(model, cfg, comm, policy, units, torch_optimizer, scheduler, ledger, batch,
                    executors)
    engine._steps_in_backward = placement.step_in_backward  # the key as resolved above
    engine.config = config_dict(config if config is not None else config_params, cfg)
    if placed is not None:
        placed.shown_in(engine.config)
    if policy.shard_weights:
        attach_ds_views(model, units)  # see [Note: ds_* views]
    engine.placement = placement
    engine.rss_watch = host_budget.RssWatch(ledger, parse_size(cfg.memory.rss_margin, "memory.rss_margin"),
                                            comm.device.type == "cpu")
    engine._attachment.watches.append(engine.rss_watch)
    if nvme is not None:  # closed (files removed) when the engine is released, after the units
        engine._attachment.tiers.append(nvme)
        engine.nvme_tier = nvme
        nvme.stats.reset()  # the first step's I/O count starts here, after the files were filled
    _configure_activation_checkpointing(cfg, ledger)
    release_free_host_memory("initialize")  # what building and laying out the model freed
    report_startup(engine)
    dataloader = _dataloader(training_data, batch[1], comm, collate_fn)
    engine.training_dataloader = dataloader
    return engine, torch_optimizer, dataloader, scheduler


def _configure_activation_checkpointing(cfg: ZeroKitConfig, ledger: Ledger) -> None:
    """zerokit.activations counts kept activations in this engine's ledger, and takes the
    config's activation_checkpointing section where it has one (DeepSpeed's engine does the
    same); a configure() the user made stays otherwise."""
    from zerokit import activations

    activations.use_ledger(ledger)
    if "activation_checkpointing" in cfg.model_fields_set:
        activations.configure(None, deepspeed_config=cfg)


def _check_nvme(cfg, placement: PlacementPolicy, layouts: list[UnitLayout], kind: str | None,
                constructed: tuple[int, int, str | None] = (0, 0, None)) -> list[str]:
    """offload_optimizer / offload_param device 'nvme': each path checked against what the plan
    puts there (nvme_plan.py). Returns the paths in use, the optimizer's first ([] when nothing
    is on NVMe). constructed: zero.Init's weight files (zero.py `constructed_nvme_files`), which
    take part of the free space now and are removed as the units are laid out."""
    zero = cfg.zero_optimization
    largest = max((lay.nvme_numel for lay in layouts), default=0) if placement.nvme else 0
    shards = [lay.record("shard") for lay in layouts if lay.has("shard_buffer")]
    total, largest_file, folder = constructed

    def check(path: str, need: int, **what) -> None:
        back = max(0, total - largest_file) if folder and _same_disk(path, folder) else 0
        if back:  # without this a model built on NVMe counted its weights twice (the 7B row)
            what["what"] = (what.get("what", "master, gradient and optimizer state on NVMe")
                            + f", less {host_budget.size(back)} of zero.Init files removed as it is laid out")
        nvme_plan.check_nvme_path(path, need - back, **what)

    paths = []
    if largest:
        second_slot = (host_budget.speculation_need(layouts, kind, placement.master_dtype,
                                                    placement.state_dtype)[2]
                       if placement.step_in_backward else 0)
        check(zero.offload_optimizer.nvme_path,
              nvme_plan.nvme_need(layouts, kind, placement.state_dtype) + second_slot
              + (nvme_plan.weight_need(layouts) if shards and _same_disk(
                  zero.offload_param.nvme_path, zero.offload_optimizer.nvme_path) else 0))
        paths.append(zero.offload_optimizer.nvme_path)
    if shards:
        check(zero.offload_param.nvme_path, nvme_plan.weight_need(layouts),
              section="offload_param", what="16-bit weight shards on NVMe")
        paths.append(zero.offload_param.nvme_path)
    return paths


def _same_disk(a: str, b: str) -> bool:
    """Whether two paths share a filesystem (and so its free space); a missing path is refused
    by its own check."""
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def _nvme_executor(cfg, units: list[Unit], nvme: NvmeTier, torch_optimizer, ledger: Ledger,
                   placement: PlacementPolicy) -> NvmeExecutor:
    executor = NvmeExecutor(units, nvme, stream_settings(cfg, placement, [u.layout for u in units]),
                            ledger, placement)
    executor.bind(torch_optimizer)  # fails here, naming the optimizer, if it has no host kernel
    return executor


def _speculation_fits(cfg, placement: PlacementPolicy, layouts: list[UnitLayout], kind: str | None,
                      avail: int, rank: int) -> bool:
    """step_in_backward: whether the host holds what its rollbacks need (parts/speculation.py);
    if not, one line says so, with the bytes, and the engine steps in step() instead."""
    need = planned_host_need(cfg, placement, layouts, kind)
    ranks = host_budget.local_ranks()
    if need.total * ranks <= avail:
        return True
    if rank == 0:
        held, restores, _ = host_budget.speculation_need(layouts, kind, placement.master_dtype,
                                                         placement.state_dtype,
                                                         placement.gradient_dtype)
        logging.getLogger("zerokit").warning(
            "zerokit: offload_optimizer.step_in_backward off: the plan with it needs %s of host "
            "memory per rank (%s of it gradients held until the step decides and %s of restores) "
            "x %d rank(s), but %s is available; stepping in step() instead",
            host_budget.size(need.total), host_budget.size(held), host_budget.size(restores),
            ranks, host_budget.size(avail))
    return False


def _enable_speculation(executors: list) -> None:
    """step_in_backward: the kernel executors' restores (parts/speculation.py; allocated through
    their tiers, counted there)."""
    for executor in executors:
        if isinstance(executor, HostExecutor):
            executor.enable_speculation()


def _count_held_gradients(executors: list, ledger: Ledger) -> None:
    """Gradients held in host memory (step_in_backward, or nvme_gradients 'host';
    parts/held_gradient.py) are counted in the ledger as grads when allocated (at the first
    piece), peak included."""
    for e in executors:
        if isinstance(e, HostExecutor):
            for p in e.shards:
                if p.held is not None:
                    p.held.counted = functools.partial(
                        ledger.hold_bytes, f"{p.unit.name}/held_gradient[{p.lo}]", "grads",
                        TierName.HOST)


def _auto_ratio(placement: PlacementPolicy, plan, device: torch.device, dtype: torch.dtype
                ) -> PlacementPolicy:
    """ratio "auto": measured rates and the device memory free now (before the units' buffers
    exist: the layout is planned from the ratio), over the optimizer elements of this rank."""
    from zerokit.engine.auto_ratio import choose_ratio

    all_on_device = plan(dataclasses.replace(placement, ratio=0.0, auto=False))
    numel = sum(layout.opt_range[1] - layout.opt_range[0] for layout in all_on_device if layout.parts)
    master = torch.empty(0, dtype=placement.master_dtype).element_size()
    state = 8 * torch.empty(0, dtype=placement.state_dtype).element_size() // 4  # Adam's two
    # per element on the device: master (none of its own in fp32 training) + state + gradient
    ratio, why = choose_ratio(numel, device, (master if dtype != torch.float32 else 0) + state + master)
    # Rank 0's reason is in the start-up plan (placement.describe); each rank's at debug.
    logging.getLogger("zerokit").debug("offload_optimizer.ratio auto: %s", why)
    return dataclasses.replace(placement, ratio=ratio, auto=False, auto_reason=why)


def _executors(units: list[Unit], placement: PlacementPolicy, torch_optimizer: torch.optim.Optimizer,
               ledger: Ledger) -> list:
    """The optimizer executors, host first (its worker starts before the device step)."""
    executors = []
    if placement.offloads:
        host = HostExecutor(units, placement)
        host.bind(torch_optimizer)  # fails here, naming the optimizer, if it has no host kernel
        executors.append(host)
    return executors + [DeviceExecutor(units, torch_optimizer, ledger)]


def _scheduler(cfg, lr_scheduler: Any, torch_optimizer: torch.optim.Optimizer, user_optimizer: Any):
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ValueError(f"an lr_scheduler was passed to initialize() and the config has a "
                         f"'scheduler' section (type {cfg.scheduler.type}): keep one of them")
    if cfg.scheduler is not None:
        return build_scheduler(cfg.scheduler.type, dict(cfg.scheduler.params), torch_optimizer)
    if lr_scheduler is None:
        return None
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return lr_scheduler(torch_optimizer)  # a factory, as DeepSpeed accepts
    # A scheduler built on the user's optimizer: point it at the one that steps the shards.
    if getattr(lr_scheduler, "optimizer", None) is user_optimizer:
        lr_scheduler.optimizer = torch_optimizer
    return lr_scheduler


def _dataloader(training_data: Any, micro_batch: int, comm: Comm, collate_fn: Any):
    if training_data is None:
        return None
    from zerokit.checkpoint.dataloader import ResumableDistributedSampler
    from zerokit.engine.training_loader import TrainingDataLoader

    # Resumable: a checkpoint records the epoch and how far into it training has read. The
    # loader's own generator keeps iter(loader) from drawing on the global RNG a resume restores.
    sampler = ResumableDistributedSampler(training_data, num_replicas=comm.world_size, rank=comm.rank)
    return TrainingDataLoader(training_data, batch_size=micro_batch, sampler=sampler,
                              collate_fn=collate_fn, drop_last=True, generator=torch.Generator())
