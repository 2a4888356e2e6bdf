"""deepspeed.runtime.lr_schedules: the schedules zerokit implements, under DeepSpeed's names.

VALID_LR_SCHEDULES names the classes here; Accelerate checks a scheduler's class name against it
to tell DeepSpeed's schedules from torch's. DeepSpeed's LRRangeTest and OneCycle are not
implemented (the config rejects them too).
"""
from zerokit.engine.lr_schedules import SCHEDULERS, WarmupCosineLR, WarmupDecayLR, WarmupLR

VALID_LR_SCHEDULES = list(SCHEDULERS)

__all__ = ["VALID_LR_SCHEDULES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
