"""`engine.optimizer` under DeepSpeed's API: what DeepSpeed's ZeRO optimizer wrapper answers.

DeepSpeed's engine hands out its ZeRO optimizer (DeepSpeedZeroOptimizer, ..._Stage3) as the
optimizer `initialize` returns and as `engine.optimizer`; the basic torch optimizer is its
`.optimizer`. Scripts and libraries read a few of its members: Accelerate `overflow`, loss-scale
logging `cur_scale` / `loss_scale`, schedulers `param_groups`. This view answers those from the
engine (the loss scaler, the last step) and the torch optimizer over the fp32 master shards.

The rest of DeepSpeed's wrapper is its internal machinery (buckets, hooks, partitions); each such
name raises NotImplementedError naming itself and what to use instead (`DEEPSPEED_ONLY`), so a
script never gets a silent AttributeError or a value with another meaning. A name DeepSpeed's
wrapper does not have either is forwarded to the torch optimizer (`defaults`, ...).
"""
from __future__ import annotations

from typing import Any

import torch

# Public members of DeepSpeed 0.19.8's ZeRO optimizers (stage 1-2 and stage 3) that this view does
# not provide. Regenerate with: sorted(n for n in dir(DeepSpeedZeroOptimizer) + dir(
# DeepSpeedZeroOptimizer_Stage3) if not n.startswith("_")) minus what the view defines.
DEEPSPEED_ONLY = frozenset("""
allreduce_and_copy allreduce_and_copy_with_multiple_ranks allreduce_and_scatter allreduce_bucket
allreduce_no_retain async_accumulate_grad_in_cpu_via_gpu async_inplace_copy_grad_to_fp32_buffer_from_gpu
average_tensor backward_epilogue backward_prologue buffered_reduce_fallback check_overflow
checkpoint_event_epilogue checkpoint_event_prologue clear_backward_seen_flag clear_grad_attribute
complete_grad_norm_calculation_for_cpu_offload configure_autoep_folding_tp_gradient_reduction
copy_grads_in_partition create_gradient_handling_hooks create_reduce_and_remove_grad_hooks
create_zenflow_hooks destroy dump_post_step_gradients dump_pre_step_gradients enter_backward
exit_backward fill_grad_accum_attribute finalize_gradient_accumulation_boundary flatten_and_print
flatten_dense_tensors_aligned free_grad_in_param_list get_all_grad_tensors get_bit16_param_group
get_data_parallel_partitions get_ep_ranks get_first_param_index get_flat_partition
get_fp32_grad_for_param get_fp32_grad_partitions get_full_hp_param get_grad_norm_direct
get_grad_position get_gradient_for_reduction get_grads_to_reduce get_groups_without_padding
get_hp_param_device get_lean_optimizer_state get_local_fp32_grad_for_param get_local_fp32_param
get_param_comm_dtype get_param_gradient_attribute get_param_id get_partition_info
gradient_reduction_w_predivide has_overflow has_overflow_partitioned_grads_serial has_overflow_serial
independent_gradient_partition_epilogue initialize_ds_offload initialize_gradient_partition
initialize_gradient_partitioning_data_structures initialize_optimizer_states
invalidate_secondary_tensor is_gradient_accumulation_boundary is_moe_group load_hp_checkpoint_state
load_hp_checkpoint_state_from_checkpoint_dir load_hp_checkpoint_state_from_checkpoint_dir_stage3
load_module_checkpoint_state_from_checkpoint_dir_stage3 load_state_dict needs_scaler offload_states
overlapping_partition_gradients_reduce_epilogue override_loss_scale partition_grads print_rank_0
process_gradients quantize_nontrainable_params queue_post_backward_callback reduce_gradients
reduce_independent_p_g_buckets_and_remove_grads reduce_ipg_grads reduce_ready_partitions_and_remove_grads
reenter_backward_if_needed refresh_fp32_params register_grad_acc_post_hook reload_states
report_ipg_memory_usage reset_cpu_buffers reset_partition_gradient_structures reset_swap_buffers
run_grad_acc_post_hooks scale_if_loss scaled_global_norm sequential_execution set_fp32_grad_for_param
set_full_hp_param set_grad_positions set_gradient_accumulation_boundary set_local_grad_for_param
set_local_hp_param set_none_gradients_to_zero set_norm_for_param_grad set_norm_for_param_grad_in_gpu
setup_buckets should_refresh_expected_hook_count state_dict step unregister_grad_acc_post_hooks
unscale_and_clip_grads update_fp32_grad_for_param_vectorized update_hook_state_and_maybe_run_epilogue
update_lp_params update_offload_overflow_tracker update_offload_overflow_tracker_for_param_grad
zero_reduced_gradients loss_scaler
""".split())

# What to use instead, where zerokit has it elsewhere.
_INSTEAD = {
    "step": "engine.step() (it steps at the accumulation boundary and publishes the new weights)",
    "state_dict": "engine.save_checkpoint(dir) (the optimizer state is sharded per rank)",
    "load_state_dict": "engine.load_checkpoint(dir)",
    "is_gradient_accumulation_boundary": "engine.is_gradient_accumulation_boundary()",
    "set_gradient_accumulation_boundary": "engine.set_gradient_accumulation_boundary(b)",
    "offload_states": "engine.offload_states()", "reload_states": "engine.reload_states()",
    "destroy": "engine.destroy()", "loss_scaler": "engine.optimizer.cur_scale / loss_scale",
    "get_full_hp_param": "engine.consolidated_fp32_state_dict()",
}


class DeepSpeedOptimizerView:
    """What deepspeed.initialize returns as the optimizer, and engine.optimizer under its API."""

    def __init__(self, engine: Any, optimizer: Any):
        self._engine = engine
        self._wrapped = optimizer

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The basic torch optimizer, stepping this rank's fp32 master shards."""
        return getattr(self._wrapped, "optimizer", self._wrapped)

    @property
    def overflow(self) -> bool:
        """The last optimizer step was skipped (fp16 overflow)."""
        return self._engine.overflow

    @property
    def cur_scale(self) -> float:
        """The loss scale the next backward multiplies by (1.0 without fp16)."""
        return self._engine.loss_scale

    loss_scale = cur_scale  # DeepSpeed's property over cur_scale

    @property
    def dynamic_loss_scale(self) -> bool:
        return self._engine.loss_scaler.dynamic

    @property
    def clip_grad(self) -> float:
        """The config's gradient_clipping."""
        return self._engine.config.gradient_clipping

    @property
    def param_groups(self) -> list[dict]:
        return self._wrapped.param_groups

    @property
    def state(self) -> dict:
        return self._wrapped.state

    def get_lr(self) -> float:
        """The first param group's learning rate, as DeepSpeed's ZeRO optimizer returns it."""
        return self.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        for group in self.param_groups:
            group["lr"] = lr

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """DeepSpeed's optimizer.backward: the loss times the loss scale, not divided by the
        accumulation steps (engine.backward divides)."""
        self._engine.backward(loss, retain_graph=retain_graph, scale_wrt_gas=False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """engine.zero_grad(): the engine clears gradients after each step (see there)."""
        self._engine.zero_grad()

    def empty_partition_cache(self) -> None:
        self._engine.empty_partition_cache()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_engine", "_wrapped"):
            raise AttributeError(name)
        if name in DEEPSPEED_ONLY:
            instead = _INSTEAD.get(name)
            raise NotImplementedError(
                f"engine.optimizer.{name} (a member of DeepSpeed's ZeRO optimizer) is not provided by "
                f"zerokit" + (f"; use {instead}" if instead else ": it is DeepSpeed's internal "
                              f"machinery, which zerokit's units replace"))
        return getattr(self._wrapped, name)

    def __repr__(self) -> str:
        return f"DeepSpeedOptimizerView({self._wrapped!r})"
