"""A read lease: background work that reads training state in place, and waiting for it.

An asynchronous checkpoint save writes the master, the optimizer state and the weight shards from
where they live (see [Note: async save without a host copy] in checkpoint/save.py). Whatever would
change those bytes next (the engine's step, an edit through GatheredParameters) settles the lease
first: it waits until the reader is done reading, which costs nothing when the write finished
during the forward and backward in between. Each engine holds one (`engine.save_lease`) and shares
it with its units (`unit.lease`), so an edit that starts from a parameter finds it; a unit outside
any engine has a lease of its own that nothing takes.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger("zerokit")


class ReadLease:
    """At most one background job at a time; it holds the lease until it calls `release`."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._reading = threading.Event()
        self._reading.set()  # nothing reads
        self._errors: list[BaseException] = []
        self.staging = None  # the job's reusable host buffer (checkpoint/staging.py), kept between jobs

    def start(self, job: Callable[[Callable[[], None]], None], name: str) -> None:
        """Run `job(release)` on a thread. The lease is held from now until the job calls
        `release()` (or ends); an exception it raises is re-raised by `wait`."""
        self.wait()
        self._reading.clear()

        def run() -> None:
            try:
                job(self._reading.set)
            except BaseException as e:  # noqa: BLE001 - re-raised by wait() on the owner's thread
                self._errors.append(e)
            finally:
                self._reading.set()
        self._thread = threading.Thread(target=run, name=name)
        self._thread.start()

    @property
    def held(self) -> bool:
        return not self._reading.is_set()

    def settle(self) -> None:
        """Before changing the state a job may read: wait until it no longer reads."""
        if not self._reading.is_set():
            t0 = time.perf_counter()
            self._reading.wait()
            log.debug("waited %.3f s for an asynchronous save to finish reading the training state",
                      time.perf_counter() - t0)

    def wait(self) -> None:
        """Until the job has ended; raises what it raised (once)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        if self._errors:
            error, self._errors = self._errors[0], []
            raise error
