"""DeepSpeed's model-state estimators, answered with zerokit's byte rules (zerokit.memory).

DeepSpeed's `estimate_zero{2,3}_model_states_mem_needs_all_live(model, num_gpus_per_node,
num_nodes, additional_buffer_factor)` print a table of per-CPU (per node) and per-GPU bytes for
its offload choices. Under `import deepspeed` the run is zerokit's, so the same table, same rows
and format, carries what zerokit allocates: the estimator's model states (fp16 compute, Adam, as
DeepSpeed's figures assume) per rank, host bytes times the GPUs of a node (they share its RAM)
times `additional_buffer_factor` (DeepSpeed's margin, kept). Building the model before
`initialize` costs the host what DeepSpeed counts too (4 bytes per parameter per GPU without
zero.Init, the largest layer's with it): the per-CPU figure is the larger of the two.
"""
from __future__ import annotations

import torch.nn as nn

from zerokit.memory import estimate


def largest_layer_params(model: nn.Module) -> int:
    return max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)


def model_states(model: nn.Module, world: int, stage: int, offload_optimizer: bool,
                 offload_param: bool = False) -> tuple[int, int]:
    """(host bytes per rank, device bytes per rank) for zerokit's plan of `model`."""
    est = estimate(model, world, stage=stage, offload_optimizer="cpu" if offload_optimizer else "none",
                   offload_param="cpu" if offload_param else "none", dtype="fp16", activations=False)
    return est.tier("host"), est.tier("device")


def print_table(header: str, rows: list[tuple[int, int, str]]) -> None:
    """DeepSpeed's layout, line for line."""
    print(header)
    print("  per CPU  |  per GPU |   Options")
    for cpu_mem, gpu_mem, options in rows:
        print(f" {cpu_mem/2**30:7.2f}GB | {gpu_mem/2**30:6.2f}GB | {options}")


def hardware_line(num_gpus_per_node: int, num_nodes: int) -> str:
    nodes_str = "nodes" if num_nodes > 1 else "node"
    gpus_str = "GPUs" if num_gpus_per_node > 1 else "GPU"
    return (f"Estimated memory needed for params, optim states and gradients for a:\n"
            f"HW: Setup with {num_nodes} {nodes_str}, {num_gpus_per_node} {gpus_str} per node.\n")


def check_args(num_gpus_per_node, num_nodes, additional_buffer_factor) -> None:
    for name, value in (("num_gpus_per_node", num_gpus_per_node), ("num_nodes", num_nodes)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int (got {value!r})")
    if not isinstance(additional_buffer_factor, (int, float)) or additional_buffer_factor <= 0:
        raise ValueError(f"additional_buffer_factor must be a positive number (got "
                         f"{additional_buffer_factor!r})")


def total_params(model: nn.Module) -> int:
    return sum({id(p): p.numel() for p in model.parameters()}.values())  # tied weights once
