"""When a unit's weights are gathered and released: the stage-3 scheduler, or none needed."""
from zerokit.gather.resident import ResidentSchedule
from zerokit.gather.scheduler import Stage3Scheduler

__all__ = ["ResidentSchedule", "Stage3Scheduler", "schedule_for"]


def schedule_for(units, comm, zero_cfg, root, policy):
    """The gather schedule the partition policy needs: weights sharded -> gathered around use."""
    return Stage3Scheduler(units, comm, zero_cfg, root) if policy.shard_weights else ResidentSchedule()
