"""deepspeed.runtime.zero.partition_parameters: zerokit.zero's Init and GatheredParameters, the
ZeroParamStatus of a parameter's `ds_status`, and the patch points transformers wraps around
zero.Init (`zero_wrapper_for_fp_tensor_constructor`, `_orig_torch_arange`).

zerokit's Init does not patch torch's tensor constructors (DeepSpeed's does, to build tensors on
the device in the config's dtype): `zero_wrapper_for_fp_tensor_constructor` is DeepSpeed's
function, kept so that code replacing it around zero.Init (transformers'
`prevent_arange_dtype_change`) finds it; zerokit never calls it.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from zerokit.compat.deepspeed.accelerator import get_accelerator
from zerokit.units.ds_attributes import ZeroParamStatus
from zerokit.units.registry import unit_of
import zerokit.zero
from zerokit.zero import GatheredParameters

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "get_accelerator", "register_external_parameter",
           "zero_wrapper_for_fp_tensor_constructor"]

_orig_torch_arange = torch.arange


class Init(zerokit.zero.Init):
    """zerokit.zero.Init, which already takes DeepSpeed's signature (every keyword is honoured or
    refused by name); entering it also routes transformers' from_pretrained to the streaming
    loader."""

    def __enter__(self) -> "Init":
        # transformers' from_pretrained enters this just before it loads the checkpoint: make its
        # load stream each rank's shards (compat/hf_pretrained.py) instead of rank 0 reading all.
        from zerokit.compat.hf_pretrained import install_if_imported

        install_if_imported()
        return super().__enter__()


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype,
                                           target_device: Any = None) -> Callable:
    """DeepSpeed's wrapper: `fn` building tensors on `target_device`, floating ones cast to
    `target_fp_dtype`."""
    def wrapped_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if tensor.is_floating_point():
            tensor = tensor.to(target_fp_dtype)
        return tensor
    return wrapped_fn


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed: gather `parameter` (owned by another module) whenever `module` runs. Nothing to
    do for a parameter zerokit does not partition; for a partitioned one, not implemented."""
    if unit_of(parameter) is None:
        return
    raise NotImplementedError(
        f"register_external_parameter({type(module).__name__}, parameter of shape "
        f"{tuple(parameter.shape)}): using a stage-3 parameter outside the module that owns it is "
        f"not supported yet (issue \"Robustness\"); wrap both modules in one unit (initialize(wrap=...))")
