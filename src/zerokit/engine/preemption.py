"""Preemption: on SIGTERM, finish the step on every rank, save, and exit with a known code.

[Note: preemption]
Schedulers (Slurm, Kubernetes) send SIGTERM some seconds before they kill a job. The handler
only sets a flag (a signal can arrive anywhere: inside a collective, between a reduction and
its use); the ranks agree on it at the next boundary step, inside the one all-reduce the step
does anyway (see [Note: non-finite steps] in engine/health.py), so every rank stops after the
same step even when the signal reached them at different moments, or reached only one. That
step is completed (its update applied and published), then, if `preemption.save_dir` is set, a
checkpoint is saved there (the default tag, `latest` updated) and waited for, and `step()`
raises SystemExit(PREEMPTED_EXIT_CODE). A second SIGTERM restores the default action and
re-delivers the signal: the process ends at once (killed by SIGTERM: status 143 in a shell,
-15 as Python's returncode). The handler is installed only in the main thread and only where
SIGTERM has its default action (a handler of the user's or a launcher's is left alone), and
removed when the engine is destroyed or collected. A signal after the last step is not acted on.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerokit.config.schema import PreemptionConfig
    from zerokit.engine.engine import Engine

log = logging.getLogger("zerokit")

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, the job may be resumed


class Preemption:
    def __init__(self, cfg: "PreemptionConfig") -> None:
        self.save_dir = cfg.save_dir
        self.requested = False   # this rank received SIGTERM
        self.agreed = False      # some rank did, by the last step's all-reduce: stop after it
        self._installed = False

    @classmethod
    def install(cls, engine: "Engine", cfg: "PreemptionConfig") -> "Preemption":
        self = cls(cfg)
        if (cfg.handle_sigterm and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
            weakref.finalize(engine, self.close)  # destroy() or a dropped engine: let go
        return self

    def _on_sigterm(self, signum: int, _frame: object) -> None:
        if self.requested:  # the second one: the default action, now
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.requested = True
        log.warning("zerokit: SIGTERM received: finishing the current step%s, then exiting with "
                    "code %d (a second SIGTERM exits at once)",
                    f", saving a checkpoint to {self.save_dir}" if self.save_dir else "",
                    PREEMPTED_EXIT_CODE)

    def close(self) -> None:
        if self._installed and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            except ValueError:  # not the main thread (a finalizer run elsewhere): leave it
                return
        self._installed = False

    def after_step(self, engine: "Engine") -> None:
        """At the end of a boundary step: save and exit if the ranks agreed to stop."""
        if not self.agreed:
            return
        if self.save_dir:
            from zerokit.checkpoint.save import wait_for_checkpoint

            engine.save_checkpoint(self.save_dir)
            wait_for_checkpoint(engine)  # an async save must be on disk before the exit
        if engine.comm.rank == 0:
            log.warning("zerokit: preempted after global step %d%s; exiting with code %d",
                        engine.global_steps,
                        f", checkpoint saved to {self.save_dir}" if self.save_dir else "",
                        PREEMPTED_EXIT_CODE)
        raise SystemExit(PREEMPTED_EXIT_CODE)
