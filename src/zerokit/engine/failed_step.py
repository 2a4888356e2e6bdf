"""What a step that raised leaves behind: the engine as after a skipped step when it can train
on, or failed for good (EngineFailedError on every later forward, backward, step and save) when
no later step may build on its state. A base of Engine, beside its other method groups."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from zerokit.comm.collectives import CollectiveError
from zerokit.states import TrainingState, move

if TYPE_CHECKING:
    from zerokit.units.unit import Unit

log = logging.getLogger("zerokit")


class FailedSteps:
    """Engine's failure handling (uses the engine's executors, counters and publish path)."""

    def _abandon_step(self, trainable: list[Unit], error: BaseException) -> None:
        """The update raised: leave the engine as after a skipped step and say so.

        This step's gradients are discarded, the weights are published from the fp32 masters
        (so every rank's parameters are whatever the optimizer left in them), and the counters,
        the LR scheduler and the loss scale stay as they were. Training can go on with the next
        batch; updates the optimizer had already applied to some parameters (or the host part
        of an offloaded shard) before raising cannot be undone, and stay.
        """
        for u in trainable:
            u.master.grad = None
        if not isinstance(error, Exception):
            return  # KeyboardInterrupt and the like: the process is going down
        if isinstance(error, CollectiveError):  # no further collective is safe
            note = (f"zerokit: engine.step() at global step {self.global_steps} failed in a "
                    f"collective; the ranks may no longer agree, so this engine cannot train on: "
                    f"restart the job (from the last checkpoint).")
            self._fail(note, error)
        elif self.stepped_in_backward:  # updates applied in backward cannot be taken back
            note = (f"zerokit: engine.step() at global step {self.global_steps} failed after "
                    f"offload_optimizer.step_in_backward had applied the offloaded update of some "
                    f"units during backward, so the weights are neither the old nor the new ones: "
                    f"this engine cannot train on; load the last checkpoint.")
            self._fail(note, error)
        elif _is_nvme_failure(error):  # the stream stopped between sub-groups' writes
            note = (f"zerokit: engine.step() at global step {self.global_steps} failed on the "
                    f"NVMe tier ({error}); the fp32 masters and optimizer state in the swap files "
                    f"may be partly updated, so this engine cannot train on: free the disk and "
                    f"load the last checkpoint.")
            self._fail(note, error)
        else:
            self._abandoned_step = self.global_steps  # the next step tells the other ranks
            for executor in self.executors:  # join any host update still running, write it back
                executor.before_step()
            self._publish(trainable)
            self._clear_grads()
            self.wait_for_weights()
            note = (f"zerokit: engine.step() at global step {self.global_steps} failed; its "
                    f"gradients were discarded and the weights republished from the fp32 masters "
                    f"(any update the optimizer applied before raising stays). The engine can "
                    f"train on.")
        if hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(note)
        log.error(note)

    def _fail(self, note: str, error: BaseException) -> None:
        """Nothing after this may train on or save the engine's state: forward, backward, step
        and save_checkpoint raise EngineFailedError with `note`; destroy() still works."""
        self._failure = f"{note} The failure: {type(error).__name__}: {error}"
        self.training_state = move(self.training_state, TrainingState.FAILED, "the engine")


def _is_nvme_failure(error: BaseException) -> bool:
    from zerokit.io.aio import AioError  # only a step that failed asks: no I/O engine otherwise

    return isinstance(error, AioError)
