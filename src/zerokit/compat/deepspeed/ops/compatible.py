"""`deepspeed.ops.__compatible_ops__`: which of DeepSpeed's op builders this installation offers.

DeepSpeed probes each op builder (a compiler run per op) and maps its name to whether it can be
built here; `ds_report` and some tests read the dict. zerokit builds no ops at run time: an op
is True where zerokit provides what it is for (the native host optimizers, its own async I/O),
False for the rest of DeepSpeed's CPU-accelerator names, as DeepSpeed reports an op it cannot
build. A name not listed is an op zerokit has no counterpart for.
"""
from __future__ import annotations


def compatible_ops() -> dict[str, bool]:
    return {
        "deepspeed_not_implemented": False,
        "async_io": True,  # NVMe offload: zerokit's own I/O engine (io/aio.py; native or threads)
        "deepspeed_ccl_comm": False,  # oneCCL: zerokit uses torch.distributed (gloo / NCCL)
        "deepspeed_shm_comm": False,  # DeepSpeed's shared-memory all-reduce: likewise
        "cpu_adagrad": True,  # zerokit.optim.HostAdagrad (native)
        "cpu_adam": True,  # zerokit.optim.HostAdam (native)
        "cpu_lion": True,  # zerokit.optim.HostLion (native)
        "fused_adam": True,  # deepspeed.ops.adam.FusedAdam: torch's Adam
        "pin_memory": True,  # host tiers pin their buffers where CUDA exists
    }
