"""deepspeed.runtime.zero.stage_1_and_2: the ZeRO-2 model-state estimator (zerokit's figures;
see _estimates.py)."""
from __future__ import annotations

import torch.nn as nn

from zerokit.compat.deepspeed.runtime.zero import _estimates as E
from zerokit.compat.deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

CPU = f"{OffloadDeviceEnum.cpu:4}"  # as DeepSpeed formats it (its enum's format, padded)


def estimate_zero2_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print per-CPU (node) and per-GPU bytes of zerokit's ZeRO-2 with and without
    offload_optimizer cpu, as DeepSpeed's function of this name prints its own."""
    E.check_args(num_gpus_per_node, num_nodes, additional_buffer_factor)
    world = num_gpus_per_node * num_nodes
    total = E.total_params(model)
    rows = []
    for cpu_offload in (True, False):
        host, device = E.model_states(model, world, 2, cpu_offload)
        built = 4 * total  # each rank builds the fp32 model on the host before initialize
        cpu_mem = max(host, built) * num_gpus_per_node * additional_buffer_factor
        rows.append((cpu_mem, device, f"offload_optimizer={CPU if cpu_offload else 'none'}"))
    E.print_table(E.hardware_line(num_gpus_per_node, num_nodes)
                  + f"SW: Model with {int(total/1e6)}M total params.", rows)
