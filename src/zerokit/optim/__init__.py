"""Host (CPU) optimizers: native SIMD/OpenMP kernels with fused mixed precision.

    HostAdam, HostAdagrad, HostLion   torch.optim.Optimizer drop-ins for fp32 CPU parameters
    Lion                              Lion in torch (foreach ops) for any device, same arithmetic
    host.adam_step / adagrad_step / lion_step / grad_sq_norm   flat-shard functions for the engine
    kernel_info()                     which implementation runs (native ISA or fallback), threads

See docs/host_optimizer.md.
"""
from zerokit.optim import host
from zerokit.optim.backend import available_isas, kernel_info
from zerokit.optim.lion import Lion
from zerokit.optim.optimizers import HostAdagrad, HostAdam, HostLion

__all__ = ["HostAdagrad", "HostAdam", "HostLion", "Lion", "available_isas", "host", "kernel_info"]
