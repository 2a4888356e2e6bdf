"""The DeepSpeed-style JSON configuration, as typed pydantic models.

Key names and meanings are DeepSpeed's, so an existing config works unchanged for what zerokit
implements. Every model forbids unknown keys (see errors.py for the message). Values that depend on
the world size (the batch-size triple) are resolved by `ZeroKitConfig.resolve_batch`. The
`optimizer` and `scheduler` sections and their params' checks are config/optimizer_sections.py;
what every section shares (strictness, whole floats as ints) is config/section.py.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from zerokit.config.optimizer_sections import OptimizerConfig, SchedulerConfig
from zerokit.config.section import Int, Section


class FP16Config(Section):
    enabled: bool = False
    loss_scale: float = Field(0.0, ge=0, description="0 selects dynamic loss scaling.")
    initial_scale_power: Int = Field(16, ge=0, le=64)
    loss_scale_window: Int = Field(1000, ge=1)
    hysteresis: Int = Field(2, ge=1)
    consecutive_hysteresis: bool = False
    min_loss_scale: float = Field(1.0, gt=0)
    auto_cast: bool = False
    raise_error_at_min_scale: bool = Field(
        True, description="zerokit (DeepSpeed's DynamicLossScaler argument, which its config does "
                          "not expose; true there): an overflow with the dynamic loss scale "
                          "already at min_loss_scale raises LossScaleAtMinimumError ('Current loss "
                          "scale already at minimum - cannot decrease scale anymore'); false skips "
                          "such steps, every one of them, for as long as gradients overflow.")


class BF16Config(Section):
    enabled: bool = False
    bf16_master_weights_and_grads: bool = Field(
        False, description="The master weights and the gradients the optimizer reads are bf16 "
                           "(DeepSpeed 0.18+; stages 1-3), on every tier: host parts "
                           "(`offload_optimizer` cpu), nvme parts (`offload_optimizer` nvme: bf16 "
                           "master and gradient files, half the bytes and half the step's I/O) and "
                           "the device part (no offload, Twin-Flow's ratio < 1). Every tier keeps "
                           "fp32 math, loads widen and each store rounds once (the host kernel, "
                           "zerokit/optim/host.py; its torch twin on the device, "
                           "optim/device_kernels.py), so a unit's elements get the same bits "
                           "wherever they are stepped.")
    bf16_optimizer_states: bool = Field(
        False, description="Adam's moments (Adagrad's sum, Lion's exp_avg) are bf16 too, on every "
                           "tier (bf16 state files on NVMe, bf16 tensors under torch's keys on the "
                           "device); needs bf16_master_weights_and_grads (as DeepSpeed).")
    stochastic_rounding: bool = Field(
        False, description="zerokit: round the bf16 master (and bf16 states) stochastically on "
                           "every tier, so updates below half an ulp survive on average; "
                           "reproducible from stochastic_rounding_seed, the step and the element "
                           "(zerokit/optim/rounding.py). Needs bf16_master_weights_and_grads.")
    stochastic_rounding_seed: Int = Field(
        0, ge=0, lt=2**64, description="zerokit: the seed of stochastic_rounding's random bits.")


class DelayedUpdateConfig(Section):
    enabled: bool = Field(
        False, description="zerokit (ZeRO-Offload's one-step delayed parameter update): after "
                           "warmup_steps normal steps, the host update of step t runs while step "
                           "t+1's forward and backward use the weights of step t-1. This CHANGES "
                           "THE MATH: gradients are computed on weights one update behind. With "
                           "Twin-Flow (ratio < 1) only the host part is delayed; the device part "
                           "is updated at once.")
    warmup_steps: Int = Field(10, ge=0, description="Normal (undelayed) steps before delaying.")


class OffloadOptimizerConfig(Section):
    device: Literal["none", "cpu", "nvme", "auto"] = Field(
        "none", description="Where fp32 master weights, optimizer state and gradient shards live. "
                            "zerokit: 'auto' (or the section left out) with a memory budget: the "
                            "placement planner chooses it, with ratio, max_in_cpu, buffer_count "
                            "and step_in_backward where those are not given (engine/planner.py).")
    pin_memory: bool = Field(False, description="Page-locked host buffers (faster copies on CUDA).")
    ratio: float | Literal["auto"] = Field(
        1.0, description="Twin-Flow: fraction of each rank's optimizer shard stepped on the host; "
                         "the rest is stepped on the device at the same time.")
    delayed_update: DelayedUpdateConfig = DelayedUpdateConfig()
    # device "nvme" (ZeRO-Infinity): see parts/nvme_executor.py.
    nvme_path: str | None = Field(
        None, description="device 'nvme': the directory the master, gradient and optimizer state files "
                          "go in (a zerokit-swap/rank<r>-<pid>-<hex> directory of the engine's own under it, "
                          "locked while the engine lives, removed on close).")
    buffer_count: Int = Field(
        4, ge=2, description="device 'nvme': host buffer sets the step streams sub-groups through "
                             "(read i+1 and write i-1 while i updates needs 3).")
    # On by default (DeepSpeed: off, its pipelined swapper being optional): the same kernel
    # on the same sub-groups in the same order, so the same bits, in the same buffer sets.
    pipeline_read: bool = Field(True, description="device 'nvme': read the next sub-groups "
                                                  "while one updates.")
    pipeline_write: bool = Field(True, description="device 'nvme': write a sub-group back "
                                                   "while the next updates.")
    fast_init: bool = Field(
        False, description="device 'nvme': both values give the same start: state files are "
                           "zero-filled when reserved, so no initializing step runs either way.")
    nvme_gradients: Literal["auto", "file", "host"] = Field(
        "auto", description="zerokit, device 'nvme': where the NVMe part's gradients wait for "
                            "the step. 'file': in a file per part, written as backward reduces "
                            "them (each micro-step of an accumulation reads, adds and writes it "
                            "back), read by the step (DeepSpeed's swapped gradients); 'host': "
                            "held in host memory (4 bytes per element, 2 with a bf16 master), "
                            "so the step streams master and state only and accumulation costs "
                            "no I/O. 'auto' (the default): held while stepping in backward, "
                            "else 'file', or the placement planner's choice under a memory "
                            "budget. 'host' is refused with delayed_update (it would hold two).")
    nvme_gradients_max_in_cpu: Int | None = Field(
        None, ge=0, description="zerokit, device 'nvme' with nvme_gradients 'host': gradient "
                                "elements per rank held in host memory, whole NVMe parts, first "
                                "units first (as offload_param.max_in_cpu keeps shards); the other "
                                "parts' gradients go to files as with 'file'. Left out: every "
                                "part's. At gradient_accumulation_steps m a held gradient saves "
                                "8 m bytes of file traffic per 4 bytes of RAM, against 1.5 + 0.5 m "
                                "per byte for max_in_cpu. A partial hold steps in step(): "
                                "step_in_backward 'auto' is then off (speculation holds every "
                                "gradient), true is refused.")
    gradient_dtype: Literal["auto", "master"] = Field(
        "auto", description="zerokit, device 'cpu' or 'nvme': the dtype the offloaded gradients "
                            "wait for the step in (host buffers, held gradients, NVMe gradient "
                            "files). 'auto' (the default): the reduced gradient's own 16-bit dtype "
                            "where it holds every value exactly, i.e. bf16/fp16 training with "
                            "gradient_accumulation_steps 1, reduced in 16 bits or on one rank: "
                            "half the bytes of fp32 in RAM and on disk, half the gradient I/O, "
                            "and the step reads the same values; else the master's. 'master': "
                            "the master's dtype always (fp32: DeepSpeed's). With a 16-bit "
                            "gradient, a second backward into it before step() (accumulating "
                            "without gradient_accumulation_steps) is refused, naming this key.")
    max_in_cpu: Int = Field(
        0, ge=0, description="zerokit (offload_param.max_in_cpu's precedent), device 'nvme': "
                             "optimizer elements per rank whose master, state and gradient stay "
                             "in host memory (stepped by the host kernel); the rest live on NVMe.")
    step_in_backward: bool | Literal["auto"] = Field(
        "auto", description="zerokit, device 'cpu' or 'nvme': step each unit's offloaded part as "
                            "soon as backward has reduced its gradient (in the boundary "
                            "micro-step's backward), on the host worker while backward goes on, "
                            "instead of in step(): the NVMe stream overlaps backward and its "
                            "gradients never go to disk. Speculative: it steps with 1 / loss "
                            "scale, and when the step finds that clipping applies, or an fp16 "
                            "overflow or non-finite gradient, the parts are restored (host: a "
                            "copy of master and state; NVMe: a second file slot) and stepped "
                            "again or left for the skipped step, so the result is bit-equal to "
                            "stepping in step(). 'auto' (the default): on for offloaded "
                            "optimizers without delayed_update, off where the host memory "
                            "cannot hold the restores and the held gradients (initialize logs "
                            "it); true: on (refused with delayed_update); false: off.")
    speculation: Literal["adaptive", "always"] = Field(
        "adaptive", description="zerokit, with step_in_backward: 'adaptive' (the default): a step "
                                "speculates unless the last applied step's gradient clipping "
                                "applied (a redo would likely follow); such a step's parts step "
                                "in step() from the held gradients, and speculation resumes after "
                                "a step that clipping left alone. 'always': every step speculates "
                                "(each step whose clipping applies is redone).")

    @model_validator(mode="after")
    def _valid(self) -> "OffloadOptimizerConfig":
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("offload_optimizer.device 'nvme' needs offload_optimizer.nvme_path "
                             "(a directory on the NVMe drive)")
        if self.ratio != "auto" and not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"offload_optimizer.ratio must be in [0, 1] or 'auto' (got {self.ratio!r})")
        return self


class OffloadParamConfig(Section):
    device: Literal["none", "cpu", "nvme", "auto"] = Field(
        "none", description="Stage 3: where each rank's persistent weight shard lives; gathering "
                            "copies it host -> device, then all-gathers (prefetched ahead of use). "
                            "'nvme': in a file, read into a host buffer first (tiers/nvme_shard.py). "
                            "zerokit: 'auto' (or the section left out) with a memory budget: the "
                            "placement planner chooses it, with max_in_cpu and buffer_count where "
                            "those are not given (engine/planner.py).")
    pin_memory: bool = Field(False, description="Page-locked weight shards (faster copies on CUDA).")
    nvme_path: str | None = Field(
        None, description="device 'nvme': the directory the weight shard files go in (a "
                          "zerokit-swap/rank<r>-<pid>-<hex> directory of the engine's own under it, locked while "
                          "the engine lives, removed on close).")
    buffer_count: Int = Field(
        5, ge=1, description="device 'nvme': weight shards read from NVMe ahead of their gather, "
                             "at most this many host buffers at once.")
    buffer_size: Int = Field(
        100_000_000, gt=0, description="device 'nvme': elements of the largest shard read ahead; "
                                       "a larger shard is read when its unit is gathered.")
    max_in_cpu: Int = Field(
        0, ge=0, description="device 'nvme': weight shard elements per rank (whole shards, first "
                             "units first) that stay in host memory; the rest are files. "
                             "DeepSpeed's default is 1e9; zerokit's 0 puts every shard on NVMe.")

    @model_validator(mode="after")
    def _valid(self) -> "OffloadParamConfig":
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("offload_param.device 'nvme' needs offload_param.nvme_path "
                             "(a directory on the NVMe drive)")
        return self


class ZeroConfig(Section):
    stage: Int = Field(0, ge=0, le=3, description="0: DDP, 1: optimizer state, 2: +gradients, 3: +weights.")
    reduce_bucket_size: Int = Field(500_000_000, gt=0, description="Elements per gradient collective.")
    allgather_bucket_size: Int = Field(500_000_000, gt=0, description="Elements per weight all-gather.")
    overlap_comm: bool = Field(True, description="Reduce gradients while backward runs.")
    enable_sanity_checks: bool = Field(
        False, description="Stage 3: an in-place edit of a parameter inside GatheredParameters "
                           "without modifier_rank (which discards it) raises RuntimeError on every "
                           "rank, as DeepSpeed. zerokit checks its collectives' rank agreement always.")
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    stage3_prefetch_bucket_size: Int = Field(
        50_000_000, ge=0, description="Elements gathered ahead of use (stage 3).")
    stage3_max_live_parameters: Int = Field(
        1_000_000_000, gt=0, description="Most elements gathered at once, prefetch included.")
    stage3_param_persistence_threshold: Int = Field(
        100_000, ge=0, description="Units this small stay gathered (no per-use collectives).")
    stage3_max_reuse_distance: Int = Field(
        1_000_000_000, ge=0, description="Keep a unit gathered if used again within this many elements.")
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False, description="What engine.zero_gather_16bit_weights_on_model_save() answers: the HF "
                           "Trainer and Accelerate then save the full 16-bit weights "
                           "(_zero3_consolidated_16bit_state_dict); DeepSpeed's old name "
                           "stage3_gather_fp16_weights_on_model_save is the same key.")
    sub_group_size: Int = Field(
        1_000_000_000, gt=0, description="Elements per optimizer sub-group: offload_optimizer "
                                         "device 'nvme' streams the optimizer state from NVMe "
                                         "this many elements at a time; elsewhere each unit's "
                                         "shard is stepped whole (see config/ignored.py).")
    reshard_after_forward: bool = Field(
        True, description="zerokit (FSDP's name): release a unit after its forward; False keeps "
                          "it gathered until its backward, trading memory for one all-gather.")
    async_weight_publish: bool = Field(
        False, description="zerokit: step() returns while the new weights are still being "
                           "all-gathered (stages 1-2, and stage 3's gathered units), which overlaps "
                           "that gather with the next forward. Parameters are valid only inside "
                           "forward: code that reads them after step() (an EMA, logging, a hash, a "
                           "hand-made state dict) may see a mix of old and new weights.")
    offload_optimizer: OffloadOptimizerConfig = OffloadOptimizerConfig()
    offload_param: OffloadParamConfig = OffloadParamConfig()

    @model_validator(mode="after")
    def _offload_needs_sharding(self) -> "ZeroConfig":
        if self.offload_optimizer.device in ("cpu", "nvme") and self.stage == 0:
            raise ValueError(f"zero_optimization.offload_optimizer.device "
                             f"'{self.offload_optimizer.device}' needs stage 1, 2 or 3 "
                             "(got stage 0): offload moves this rank's optimizer shard to the host")
        if self.offload_param.device in ("cpu", "nvme") and self.stage != 3:
            raise ValueError(f"zero_optimization.offload_param.device '{self.offload_param.device}' "
                             f"needs stage 3 (got stage "
                             f"{self.stage}): only stage 3 partitions the weights into shards that "
                             f"can live on the host; use offload_optimizer below stage 3")
        if self.offload_param.device == "nvme" and self.offload_optimizer.delayed_update.enabled:
            raise ValueError("offload_param.device 'nvme' with offload_optimizer.delayed_update is "
                             "not implemented (issue #16); allowed with offload_param.device 'cpu'")
        return self


class AioSection(Section):
    """DeepSpeed's `aio` section: the I/O engine of NVMe offload (zerokit.io.AioConfig)."""

    block_size: Int = Field(1 << 20, gt=0, description="Bytes per I/O request (multiple of 4096).")
    queue_depth: Int = Field(8, ge=1, description="Requests in flight per thread.")
    thread_count: Int = Field(1, ge=1, description="I/O threads (a multiplier of queue_depth).")
    intra_op_parallelism: Int | None = Field(
        None, ge=1, description="DeepSpeed's newer name for thread_count; wins where both are set.")
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = Field(False, description="GPUDirect Storage: not implemented (refused).")

    @model_validator(mode="after")
    def _valid(self) -> "AioSection":
        if self.block_size % 4096:
            raise ValueError(f"aio.block_size must be a multiple of 4096, got {self.block_size}")
        if self.use_gds:
            raise ValueError("aio.use_gds (GPUDirect Storage) is not implemented; allowed: false")
        return self

    def engine_config(self):
        from zerokit.io.aio import AioConfig

        return AioConfig(block_size=self.block_size, queue_depth=self.queue_depth,
                         thread_count=self.intra_op_parallelism or self.thread_count,
                         single_submit=self.single_submit, overlap_events=self.overlap_events)


class CheckpointConfig(Section):
    async_save: bool = Field(
        False, description="zerokit: save_checkpoint copies the shards to host memory and returns; "
                           "a background thread writes and commits (the next save or load waits).")
    load_rng_states: bool = Field(
        False, description="zerokit: load_checkpoint also sets the process's global torch (and "
                           "CUDA), numpy and python RNG states to what each rank saved, so a "
                           "resume draws what the uninterrupted run would have (dropout masks, "
                           "shuffles); load_checkpoint(load_rng_states=) overrides it for one "
                           "call. Off by default, as DeepSpeed, which never touches them.")
    tag_validation: Literal["WARN", "IGNORE", "FAIL"] = Field(
        "WARN", description="Ranks that pass different tags to save_checkpoint: 'Fail' raises on "
                            "every rank; 'Warn' (with a warning) and 'Ignore' save under rank 0's tag "
                            "(DeepSpeed saves each rank under its own). Any case, as DeepSpeed.")

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _any_case(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value


class PreemptionConfig(Section):
    handle_sigterm: bool = Field(
        True, description="zerokit: on SIGTERM (what schedulers send before a kill) finish the "
                          "current step on every rank, save a checkpoint to save_dir if set, and "
                          "exit with code 75 (zerokit.PREEMPTED_EXIT_CODE); a second SIGTERM "
                          "exits at once. Installed only where SIGTERM has its default handler.")
    save_dir: str | None = Field(
        None, description="zerokit: where the preemption checkpoint goes (save_checkpoint's "
                          "save_dir, default tag, `latest` updated); none: exit without saving.")


class ActivationCheckpointingConfig(Section):
    """DeepSpeed's `activation_checkpointing` section: how zerokit.activations.checkpoint keeps
    the inputs it saves for recomputation (zerokit/activations/)."""

    partition_activations: bool = Field(
        False, description="Each rank of the model-parallel group (configure(mpu_)) keeps 1/N of "
                           "a checkpointed input; the whole is all-gathered at recomputation.")
    cpu_checkpointing: bool = Field(
        False, description="Checkpointed inputs go to host memory as forward produces them and "
                           "are prefetched back, in reverse order, ahead of the backward.")
    contiguous_memory_optimization: bool = Field(
        False, description="Checkpointed inputs live in buffers allocated once, one slot per "
                           "checkpoint (number_checkpoints of them).")
    number_checkpoints: Int | None = Field(
        None, gt=0, description="Checkpoints per forward: the slots of the contiguous buffers.")
    synchronize_checkpoint_boundary: bool = Field(
        False, description="Synchronize the device at the start and end of every checkpoint's "
                           "forward and backward (a no-op without one).")
    profile: bool = Field(
        False, description="Time every checkpoint's forward and backward; logged at debug and "
                           "read by zerokit.activations.timings().")

    @model_validator(mode="after")
    def _slots_for_contiguous(self) -> "ActivationCheckpointingConfig":
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise ValueError("activation_checkpointing.contiguous_memory_optimization=true needs "
                             "number_checkpoints (how many checkpoints one forward makes: the "
                             "buffers' slots)")
        return self


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)\s*$")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 10**3, "MB": 10**6,
          "GB": 10**9, "TB": 10**12}


def parse_size(value: "int | str", key: str) -> int:
    """Bytes from an int or a string such as "20GiB" / "512 MB"; the error names the key."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    found = _SIZE.match(value) if isinstance(value, str) else None
    if found is None or float(found.group(1)) <= 0:
        raise ValueError(f"{key} must be a positive number of bytes or a size such as '20GiB', "
                         f"'512MiB' (units {', '.join(_UNITS)}) (got {value!r})")
    return int(float(found.group(1)) * _UNITS[found.group(2)])


class MemoryConfig(Section):
    """zerokit: memory budgets per tier, enforced by the ledger at every allocation (tiers/ledger.py
    [Note: budgets]), and the input of the placement planner (engine/planner.py, [Note: the
    placement planner]): with a budget given, offload_optimizer.device / offload_param.device
    'auto' (or their sections left out) and the max_in_cpu, buffer_count, ratio and
    step_in_backward keys left out are chosen at initialize: the fastest placement whose
    predicted bytes per tier fit the budgets (host: with the process's own memory and
    rss_margin; on a CPU-only machine the device tier's bytes too, the same RAM). Keys given by
    hand stay as given. A budget no placement fits is refused at initialize with the bytes per
    tier and kind and the smallest budget that would work."""

    host: Int | str | None = Field(
        None, description="zerokit: this rank's host-memory budget, bytes or a size ('20GiB'), or "
                          "'auto' (the memory the system or cgroup has available at initialize, less "
                          "10%, shared by the ranks on the machine). Allocations past it fail with "
                          "the breakdown; the process RSS is sampled through each step and its peak "
                          "checked against it when the step ends.")
    device: Int | str | None = Field(
        None, description="zerokit: this rank's device-memory budget (bytes or a size).")
    nvme: Int | str | None = Field(
        None, description="zerokit: this rank's NVMe budget (bytes or a size).")
    rss_margin: Int | str = Field(
        "512MiB", description="zerokit: process RSS above what the ledger counts on the host (and "
                              "on a CPU device) plus the RSS at initialize, by more than this, is "
                              "reported once as unaccounted memory.")

    @model_validator(mode="after")
    def _sizes(self) -> "MemoryConfig":
        for key in ("host", "device", "nvme", "rss_margin"):
            value = getattr(self, key)
            if value is None or (key == "host" and value == "auto"):
                continue
            parse_size(value, f"memory.{key}")
        return self


class ZeroKitConfig(Section):
    train_batch_size: Int | None = Field(None, gt=0)
    train_micro_batch_size_per_gpu: Int | None = Field(None, gt=0)
    gradient_accumulation_steps: Int | None = Field(None, gt=0)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = FP16Config()
    bf16: BF16Config = BF16Config()
    gradient_clipping: float = Field(
        0.0, ge=0, description="Max global gradient norm; 0 disables. Left out: 1.0 (DeepSpeed's "
                               "default) through deepspeed.initialize, 0 through zerokit.initialize "
                               "and zerokit train (config/deepspeed_defaults.py).")
    zero_optimization: ZeroConfig = ZeroConfig()
    aio: AioSection = AioSection()
    checkpoint: CheckpointConfig = CheckpointConfig()
    preemption: PreemptionConfig = PreemptionConfig()
    memory: MemoryConfig = MemoryConfig()
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        ActivationCheckpointingConfig(), description="zerokit.activations.checkpoint's options "
        "(partition_activations, cpu_checkpointing, contiguous_memory_optimization, "
        "number_checkpoints, synchronize_checkpoint_boundary, profile), as DeepSpeed; initialize "
        "applies them as deepspeed.checkpointing.configure(deepspeed_config=...) does.")
    nonfinite: Literal["skip", "stop"] = Field(
        "skip", description="zerokit, bf16 and fp32: a step whose loss or gradient norm is not "
                            "finite is reported (step, first unit) and skipped, counted in "
                            "skipped_steps ('skip'), or raises NonFiniteError on every rank "
                            "('stop'); never applied to the weights. fp16 keeps its loss-scale "
                            "overflow handling.")
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = Field(
        None, description="dtype of gradient collectives; default fp32 for bf16, else the compute dtype.")
    steps_per_print: Int | float = Field(
        10, gt=0, description="Print a progress line every this many steps; infinity (Accelerate "
                              "passes float('inf')) or any huge value: never.")
    prescale_gradients: bool = Field(
        False, description="Divide gradients by the world size before the reduction (sum) instead "
                           "of after it.")
    gradient_predivide_factor: float = Field(
        1.0, gt=0, description="Without prescale_gradients: divide gradients by this factor before "
                               "the reduction (sum) and by world_size / factor after it.")
    gradient_allreduce_op: Literal["mean", "sum"] = Field(
        "mean", description="How gradients combine over ranks: 'mean' averages them, 'sum' adds "
                            "them (no division by the world size, prescale_gradients and "
                            "gradient_predivide_factor unused, as DeepSpeed); 'sum' is refused at "
                            "stage 3, as DeepSpeed.")
    wall_clock_breakdown: bool = False
    comm_timeout_s: float = Field(
        1800.0, gt=0, description="zerokit: a collective that waits longer fails, naming the step.")
    # Keys config/ignored.py accepted without a schema field, {path: value}, for the start-up report.
    _ignored_raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    # Paths whose "auto" zerokit resolves (config/auto.py), and DeepSpeed's old names read as new.
    _auto_keys: set[str] = PrivateAttr(default_factory=set)
    _renamed: list[str] = PrivateAttr(default_factory=list)
    _unresolved_auto: list[str] = PrivateAttr(default_factory=list)  # a message per other "auto"

    @property
    def ignored_raw(self) -> dict[str, Any]:
        return self._ignored_raw

    @property
    def auto_keys(self) -> set[str]:
        return self._auto_keys

    @property
    def renamed(self) -> list[str]:
        return self._renamed

    @model_validator(mode="after")
    def _no_contradictions(self) -> "ZeroKitConfig":
        spp = self.steps_per_print
        if isinstance(spp, float) and spp != float("inf"):
            raise ValueError(f"steps_per_print must be a whole number or infinity (got {spp!r})")
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled=true and bf16.enabled=true contradict: choose one")
        if self.gradient_allreduce_op == "sum" and self.zero_optimization.stage == 3:
            raise ValueError("gradient_allreduce_op='sum' is not supported with ZeRO stage 3 (as in "
                             "DeepSpeed): use 'mean', or stage 0-2")
        self._check_bf16_state()
        off = self.zero_optimization.offload_optimizer
        if off.step_in_backward is True:  # "auto" turns itself off where these hold
            key = "zero_optimization.offload_optimizer.step_in_backward"
            for bad, why in ((off.device == "none", "offload_optimizer.device 'cpu' or 'nvme' (got 'none')"),
                             (off.delayed_update.enabled,
                              "offload_optimizer.delayed_update off (the delayed update steps "
                              "after backward by design; set one of the two)")):
                if bad:
                    raise ValueError(f"{key} true needs {why}")
        if off.nvme_gradients_max_in_cpu is not None:
            key = "zero_optimization.offload_optimizer.nvme_gradients_max_in_cpu"
            if off.nvme_gradients != "host":
                raise ValueError(f"{key}={off.nvme_gradients_max_in_cpu} holds part of the NVMe "
                                 f"parts' gradients in host memory: it needs offload_optimizer."
                                 f"nvme_gradients 'host' (got {off.nvme_gradients!r})")
            if off.step_in_backward is True:
                raise ValueError(f"{key}={off.nvme_gradients_max_in_cpu} with offload_optimizer."
                                 f"step_in_backward true: stepping in backward holds every "
                                 f"gradient (a redo reads them); leave {key} out or set "
                                 f"step_in_backward false")
        if off.nvme_gradients == "host" and off.delayed_update.enabled:
            raise ValueError("zero_optimization.offload_optimizer.nvme_gradients 'host' with "
                             "delayed_update is not implemented (the delayed stream reads one "
                             "step's gradients while backward writes the next: two held "
                             "buffers); give 'file' or 'auto', or turn delayed_update off")
        return self

    def _check_bf16_state(self) -> None:
        """DeepSpeed's rules for bf16 master weights and states (runtime/config.py), by key."""
        b = self.bf16
        if b.bf16_optimizer_states and not b.bf16_master_weights_and_grads:
            raise ValueError("bf16.bf16_optimizer_states=true needs bf16.bf16_master_weights_and_grads"
                             "=true (as in DeepSpeed)")
        if b.stochastic_rounding and not b.bf16_master_weights_and_grads:
            raise ValueError("bf16.stochastic_rounding=true needs bf16.bf16_master_weights_and_grads"
                             "=true: it rounds the bf16 master")
        if b.bf16_master_weights_and_grads:
            if not b.enabled:
                raise ValueError("bf16.bf16_master_weights_and_grads=true needs bf16.enabled=true")
            if self.zero_optimization.stage == 0:
                raise ValueError("bf16.bf16_master_weights_and_grads=true needs zero_optimization.stage "
                                 "1, 2 or 3 (got 0; as in DeepSpeed)")

    def gradient_reduction_scales(self, world_size: int) -> tuple[float, float | None]:
        """(factor before, factor after) the gradients' sum over ranks, DeepSpeed's rule: by
        default 1/world_size after (None: the plain average); prescale_gradients: 1/world_size
        before; gradient_predivide_factor f: 1/f before and f/world_size after;
        gradient_allreduce_op 'sum': the plain sum, whatever the others say."""
        if self.gradient_allreduce_op == "sum":
            return 1.0, 1.0
        if self.prescale_gradients:
            return 1.0 / world_size, 1.0
        f = self.gradient_predivide_factor
        if f == 1.0:
            return 1.0, None
        return 1.0 / f, f / world_size

    @property
    def compute_dtype_name(self) -> str:
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    def resolve_batch(self, world_size: int) -> tuple[int, int, int]:
        """(train_batch_size, micro_batch, grad_accum) by DeepSpeed's rule: any two give the third."""
        from zerokit.config.errors import ConfigError

        tbs, mbs, gas = (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                         self.gradient_accumulation_steps)
        if tbs is not None and mbs is not None and gas is not None:
            if tbs != mbs * gas * world_size:
                raise ConfigError(
                    f"train_batch_size={tbs} contradicts train_micro_batch_size_per_gpu={mbs} x "
                    f"gradient_accumulation_steps={gas} x world_size={world_size} = {mbs * gas * world_size}")
        elif tbs is not None and mbs is not None:
            gas, rem = divmod(tbs, mbs * world_size)
            if rem or gas == 0:
                raise ConfigError(
                    f"train_batch_size={tbs} is not a multiple of train_micro_batch_size_per_gpu={mbs} "
                    f"x world_size={world_size}")
        elif tbs is not None and gas is not None:
            mbs, rem = divmod(tbs, gas * world_size)
            if rem or mbs == 0:
                raise ConfigError(
                    f"train_batch_size={tbs} is not a multiple of gradient_accumulation_steps={gas} "
                    f"x world_size={world_size}")
        elif mbs is not None:
            gas = gas or 1
            tbs = mbs * gas * world_size
        elif tbs is not None:
            gas = 1
            mbs, rem = divmod(tbs, world_size)
            if rem or mbs == 0:
                raise ConfigError(f"train_batch_size={tbs} is not a multiple of world_size={world_size}")
        else:
            raise ConfigError(
                "set train_batch_size or train_micro_batch_size_per_gpu "
                "(gradient_accumulation_steps defaults to 1)")
        return tbs, mbs, gas
