"""Config keys zerokit accepts and does not act on, each with the reason, reported at start-up.

A DeepSpeed config carries keys for features zerokit does not have, or that zerokit's design makes
moot. Refusing them would make existing configs fail; dropping them silently would let a user
believe they act. So each such key is one line of `IGNORED` (its dotted path -> why), and
`initialize` reports the ones a config sets, once, on rank 0, through the "zerokit" logger.

- A path the schema declares (`zero_optimization.contiguous_gradients`) is validated as usual
  (type, range) and reported when the config sets it to a value outside `honoured`, the values
  that describe what zerokit always does anyway.
- A path the schema does not declare (DeepSpeed's `tensorboard`, `wandb`, ...) is accepted with
  any value: `strip_undeclared` removes it before validation, and it is reported whenever set
  to a value outside `honoured`.

Keys zerokit refuses (they would change the math, or wait for an issue) are config/refused.py;
docs/deepspeed.md shows both tables with every key zerokit implements.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zerokit.config.schema import ZeroKitConfig


@dataclass(frozen=True)
class Ignored:
    reason: str
    honoured: tuple = ()  # values zerokit acts on anyway: setting one of these is not reported


IGNORED: dict[str, Ignored] = {
    "zero_optimization.contiguous_gradients": Ignored(
        "zerokit always copies a unit's gradients into one contiguous buffer as they are produced "
        "(the unit's flat layout); false cannot turn that off", honoured=(True,)),
    "zero_optimization.reduce_scatter": Ignored(
        "zerokit always reduce-scatters gradients where they are partitioned (stages 1-3) and "
        "all-reduces them at stage 0; DeepSpeed's false (all-reduce everywhere) averages the same "
        "values with more traffic", honoured=(True,)),
    "zero_optimization.allgather_bucket_size": Ignored(
        "DeepSpeed uses it only where torch lacks all_gather_into_tensor (no torch zerokit "
        "supports) and not at stage 3; zerokit all-gathers each unit in place into the unit's own "
        "buffer, so there is no staging buffer for it to bound (stage 3 gathers are bounded by "
        "stage3_prefetch_bucket_size and stage3_max_live_parameters)"),
    "zero_optimization.sub_group_size": Ignored(
        "without offload_optimizer.device 'nvme' zerokit steps each unit's optimizer shard in "
        "one call (the unit is the sub-group), with no sub-group buffers to bound; with 'nvme' "
        "it sizes the sub-groups streamed from NVMe and is not reported",
        honoured=(1_000_000_000,)),
    **{f"zero_optimization.{key}": Ignored(reason, honoured=honoured) for key, reason, honoured in [
        ("allgather_partitions", "zerokit always all-gathers the updated partitions into each "
         "unit's buffer (false: DeepSpeed broadcasts them instead, the same values)", (True,)),
        ("use_multi_rank_bucket_allreduce", "DeepSpeed's bucketing of small all-reduces across "
         "ranks; zerokit reduces per unit in reduce_bucket_size pieces (the same values)", (True,)),
        ("compute_grad_norm", "zerokit computes the gradient norm when gradient_clipping or "
         "dynamic fp16 loss scaling needs it (get_global_grad_norm() is None otherwise)", ()),
        ("load_from_fp32_weights", "zerokit checkpoints hold the fp32 master, and loading always "
         "restores it from there", (True,)),
        ("elastic_checkpoint", "zerokit checkpoints load into any world size and stage (resharded "
         "on load), so there is nothing to enable", ()),
        ("round_robin_gradients", "a DeepSpeed stage 1-2 offload copy order; zerokit copies each "
         "bucket to the host as soon as it is reduced (the same values)", (False,)),
        ("ignore_unused_parameters", "zerokit always accepts parameters without a gradient: a "
         "unit that no rank used is left out of the step, as torch's optimizers do", (True,)),
        ("legacy_stage1", "DeepSpeed's old stage 1 implementation; zerokit has one", (False,)),
        ("parameter_alignment", "zerokit aligns every shard to its own boundary", (False,)),
        ("memory_efficient_linear", "zero.Init's linear-layer autograd function in DeepSpeed; "
         "zerokit's units need none (the same values)", (True,)),
        ("pipeline_loading_checkpoint", "for pipeline-parallel checkpoint loading; zerokit has no "
         "pipeline parallelism", (False,)),
        ("override_module_apply", "DeepSpeed patches module.apply under stage 3; zerokit gathers a "
         "unit where its module runs", (True,)),
        ("log_trace_cache_warnings", "DeepSpeed's stage 3 trace warnings; zerokit's trace reports "
         "a changed order itself", (False,)),
        ("save_muon_momentum_buffer_in_memory", "for the Muon optimizer, which zerokit does not "
         "offer", (False,)),
        ("stage3_model_persistence_threshold", "zerokit bounds persistence per unit by "
         "stage3_param_persistence_threshold only", ()),
        ("stage3_module_granularity_threshold", "zerokit's units are chosen by the wrap policy "
         "(initialize(wrap=)), not by a size threshold", (0,)),
        ("stage3_use_all_reduce_for_fetch_params", "zerokit gathers weights with all-gather "
         "(DeepSpeed's all-reduce variant moves the same values)", (False,)),
        ("stage3_allgather_sequential", "zerokit gathers each unit in one collective", (False,)),
        ("cpu_offload_use_pin_memory", "deprecated in DeepSpeed, which does not act on it either; "
         "offload_optimizer.pin_memory and offload_param.pin_memory decide", ()),
    ]},
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": Ignored(
        "zerokit's host optimizer uses the OpenMP threads of the process (OMP_NUM_THREADS)"),
    **{key: Ignored(reason, honoured=honoured) for key, reason, honoured in [
        ("tensorboard", "zerokit writes no monitor events; log from the training loop (the HF "
         "Trainer's report_to does)", ()),
        ("wandb", "zerokit writes no monitor events; log from the training loop (the HF Trainer's "
         "report_to does)", ()),
        ("csv_monitor", "zerokit writes no monitor events; log from the training loop", ()),
        ("comet", "zerokit writes no monitor events; log from the training loop", ()),
        ("comms_logger", "zerokit logs no per-collective timings (a collective that hangs fails "
         "after comm_timeout_s, naming itself)", ()),
        ("flops_profiler", "zerokit has no FLOPs profiler (use torch.profiler)", ()),
        ("autotuning", "zerokit has no autotuner; `initialize` prints the memory plan per tier and refuses one that does not fit", ()),
        ("memory_breakdown", "zerokit prints no per-step memory lines; engine.memory_report() and the "
         "start-up plan give the bytes per tier from its ledger", (False,)),
        ("hybrid_engine", "DeepSpeed's RLHF generation engine; zerokit runs the module's own "
         "generate (engine.generate) on gathered weights", ()),
        ("tensor_parallel", "zerokit is data parallel only; a tensor-parallel size of 1 (all that "
         "zerokit accepts) is plain data parallelism", ()),
        ("data_types", "zerokit accumulates gradients across micro-steps in fp32 and keeps "
         "parameters and float buffers in the compute dtype; grad_accum_dtype, param_dtype, "
         "buffer_dtype and keep_in_fp32_modules are not applied", ()),
        ("zero_allow_untested_optimizer", "zerokit steps any torch optimizer it can build over "
         "its shards; there is no list of tested optimizers to override", ()),
        ("zero_force_ds_cpu_optimizer", "zerokit picks the host optimizer for offload itself (its "
         "native HostAdam / HostAdagrad / HostLion for the optimizer's type)", ()),
        ("dump_state", "zerokit prints its effective plan at start-up (ZEROKIT_LOG=INFO)", (False,)),
        ("disable_python_gc", "zerokit leaves Python's garbage collector alone", ()),
        ("disable_allgather", "zerokit all-gathers the updated partitions always", (False,)),
        ("seq_parallel_communication_data_type", "zerokit has no sequence parallelism", ()),
        ("vocabulary_size", "used by DeepSpeed's removed sparse-embedding gradients only", ()),
        ("dataloader_drop_last", "the loader initialize(training_data=) builds always drops the "
         "last incomplete batch (every rank steps the same number of times)", (True,)),
        ("log_level", "zerokit logs through the 'zerokit' logger; ZEROKIT_LOG sets its level", ()),
        ("use_data_before_expert_parallelism", "zerokit has no expert parallelism", ()),
        ("pipeline", "settings of DeepSpeed's PipelineEngine; zerokit has no pipeline "
         "parallelism", ()),
        ("compile", "zerokit does not torch.compile the module itself; compile it before "
         "initialize", ()),
        ("timers", "zerokit's engine.tput_timer is always on", ()),
        ("datastates_ckpt", "zerokit's checkpoints are its own (atomic, resharding)", ()),
        ("optimizer.legacy_fusion", "a DeepSpeed fp16 optimizer flavour; zerokit has one", (False,)),
        ("checkpoint.use_node_local_storage", "zerokit writes every rank's files into the "
         "directory it is given, which must be shared by all nodes (the HF Trainer sets this "
         "key for save_on_each_node)", (False,)),
        ("checkpoint.load_universal", "zerokit checkpoints always load into any world size and "
         "stage (resharded on load)", ()),
        ("checkpoint.parallel_write", "pipeline-parallel checkpoint writing; zerokit has no "
         "pipeline parallelism", ()),
        ("checkpoint.checkpoint_serialization", "zerokit's own file layout", ()),
        ("checkpoint.writer", "zerokit writes with its own writer (checkpoint.async_save for "
         "background writes)", ()),
        ("bf16.immediate_grad_update", "zerokit adds each micro-step's bf16 gradients into an fp32 "
         "buffer straight away (DeepSpeed's true)", (True,)),
    ]},
}


def _split(path: str) -> tuple[str, ...]:
    return tuple(path.split("."))


def _declared(path: tuple[str, ...]) -> bool:
    from zerokit.config.errors import _model_at
    from zerokit.config.schema import ZeroKitConfig

    parent = _model_at(ZeroKitConfig, path)
    return parent is not None and any(
        path[-1] in (name, f.alias) for name, f in parent.model_fields.items())


def strip_undeclared(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(raw without the IGNORED keys the schema does not declare, {path: value} of those).

    The caller's dict is not changed: the sections on a removed key's path are copied."""
    removed: dict[str, Any] = {}
    out = raw
    for path in IGNORED:
        parts = _split(path)
        if _declared(parts):
            continue
        parent = out
        for part in parts[:-1]:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if not isinstance(parent, dict) or parts[-1] not in parent:
            continue
        if out is raw:
            out = copy.copy(raw)
        parent = out
        for part in parts[:-1]:  # copy each section on the way, then remove the key from the copy
            parent[part] = copy.copy(parent[part])
            parent = parent[part]
        removed[path] = parent.pop(parts[-1])
    return out, removed


def ignored_keys_at(path: tuple[str, ...]) -> list[str]:
    """The undeclared IGNORED keys directly under `path` (for unknown-key suggestions)."""
    return [p[-1] for p in map(_split, IGNORED) if p[:-1] == path and not _declared(p)]


def ignored_settings(cfg: "ZeroKitConfig") -> list[tuple[str, Any, str]]:
    """(path, value, reason) for every IGNORED key this config sets, in the table's order."""
    removed = cfg.ignored_raw
    found = []
    nvme = cfg.zero_optimization.offload_optimizer.device == "nvme"
    for path, entry in IGNORED.items():
        if nvme and path == "zero_optimization.sub_group_size":
            continue  # it sizes the NVMe sub-groups (parts/nvme_executor.py)
        if path in removed:
            if removed[path] not in entry.honoured:
                found.append((path, removed[path], entry.reason))
            continue
        section: Any = cfg
        parts = _split(path)
        for part in parts[:-1]:
            section = getattr(section, part, None)
        if section is None or parts[-1] not in getattr(section, "model_fields_set", ()):
            continue  # not set by the config (a default is zerokit's own choice)
        value = getattr(section, parts[-1])
        if value not in entry.honoured:
            found.append((path, value, entry.reason))
    return found


def format_ignored(found: list[tuple[str, Any, str]]) -> str:
    lines = ["config keys accepted and ignored:"]
    lines += [f"  {path}={value!r}: {reason}" for path, value, reason in found]
    return "\n".join(lines)
