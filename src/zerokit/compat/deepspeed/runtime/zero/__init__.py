"""deepspeed.zero / deepspeed.runtime.zero: Init, GatheredParameters, register_external_parameter."""
from zerokit.compat.deepspeed.runtime.zero import offload_config, partition_parameters
from zerokit.compat.deepspeed.runtime.zero.partition_parameters import (
    GatheredParameters, Init, ZeroParamStatus, register_external_parameter)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "offload_config", "partition_parameters",
           "register_external_parameter"]
