"""Stage 3: when each unit's full weights are gathered and released."""
from zerokit.schedule.scheduler import Stage3Scheduler

__all__ = ["Stage3Scheduler"]
