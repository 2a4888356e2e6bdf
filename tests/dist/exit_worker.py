"""One rank of tests/dist/test_exit.py, started as its own process as a launcher would: build an
engine, then leave with the code in argv[1] (SystemExit, as preemption does). The heartbeat
beats without pause (HEARTBEAT_S = 0), so a beat is inside the store's native call when the
interpreter finalizes, the moment that used to abort the process."""
from __future__ import annotations

import atexit
import sys
import threading


@atexit.register  # registered before zerokit is imported: runs after zerokit's exit hook
def _report_beats() -> None:
    alive = [t.name for t in threading.enumerate() if t.name == "zerokit-heartbeat" and t.is_alive()]
    print(f"HEARTBEATS ALIVE AFTER EXIT HOOKS: {len(alive)}", flush=True)


import torch  # noqa: E402

import zerokit  # noqa: E402
import zerokit.comm.collectives as collectives  # noqa: E402

collectives.HEARTBEAT_S = 0.0
engine, _, _, _ = zerokit.initialize(model=torch.nn.Linear(4, 4), config={
    "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    "zero_optimization": {"stage": 1}})
sys.exit(int(sys.argv[1]))
