"""deepspeed.runtime.zero.stage3: the ZeRO-3 model-state estimator (zerokit's figures; see
_estimates.py)."""
from __future__ import annotations

import torch.nn as nn

from zerokit.compat.deepspeed.runtime.zero import _estimates as E
from zerokit.compat.deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

CPU = f"{OffloadDeviceEnum.cpu:4}"  # as DeepSpeed formats it (its enum's format, padded)


def estimate_zero3_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print per-CPU (node) and per-GPU bytes of zerokit's ZeRO-3 for DeepSpeed's rows
    (offload_param / offload_optimizer cpu or none, with and without zero.Init)."""
    E.check_args(num_gpus_per_node, num_nodes, additional_buffer_factor)
    world = num_gpus_per_node * num_nodes
    total, largest = E.total_params(model), E.largest_layer_params(model)
    rows = []
    for cpu_offload in (True, False):
        for cpu_offload_params in (True, False):
            if not cpu_offload and cpu_offload_params:
                continue
            host, device = E.model_states(model, world, 3, cpu_offload, cpu_offload_params)
            for zero_init in (True, False):
                # built under zero.Init: one module's fp32 parameters at a time; else all of them
                built = 4 * (largest if zero_init else total)
                cpu_mem = max(host, built) * num_gpus_per_node * additional_buffer_factor
                options = (f"offload_param={CPU if cpu_offload_params else 'none'}, "
                           f"offload_optimizer={CPU if cpu_offload else 'none'}, "
                           f"zero_init={1 if zero_init else 0}")
                rows.append((cpu_mem, device, options))
    E.print_table(E.hardware_line(num_gpus_per_node, num_nodes)
                  + f"SW: Model with {int(total/1e6)}M total params, {int(largest/1e6)}M largest "
                    f"layer params.", rows)
