"""deepspeed.zero / deepspeed.runtime.zero: Init, GatheredParameters, register_external_parameter."""
from zerokit.compat.deepspeed.runtime.zero import partition_parameters
from zerokit.compat.deepspeed.runtime.zero.partition_parameters import (
    GatheredParameters, Init, ZeroParamStatus, register_external_parameter)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "partition_parameters", "register_external_parameter"]
