"""One rank of tests/dist/test_kill_under_load.py, started as its own process as a launcher would
(RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; rank 0 hosts the store, as torchrun's
rendezvous-less launch does). Trains stage 2 and, on the rank in argv[2], SIGKILLs itself at the
point of step 1 named by argv[1]:
  start: before forward;  forward: in a block's forward;  backward: in a gradient hook (the
  reductions of later units in flight);  reduced: after backward returned (every reduction
  landed on both ranks; the peer meets the death in the step's all-reduce);  step: in the
  optimizer's step (after the step's all-reduce);  publish: after step() returned.
Prints "STEP n" after each step and the error the survivor raised, with the time it took."""
from __future__ import annotations

import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reference import global_batches, rank_micro_batch, tiny_gpt  # noqa: E402

import zerokit  # noqa: E402


def main() -> None:
    point, victim = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = tiny_gpt()
    engine, optimizer, _, _ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "comm_timeout_s": 600,  # a hang shows as a hang
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 20_000}})
    armed = [False]

    def die(*_args) -> None:
        if armed[0] and rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
    if point == "forward":
        model.transformer.h[1].register_forward_pre_hook(die)
    elif point == "backward":
        model.transformer.h[0].mlp.c_fc.weight.register_hook(lambda g: (die(), g)[1])
    elif point == "step":
        optimizer.register_step_pre_hook(die)
    try:
        for step, batch in enumerate(global_batches(4, 2 * world)):
            armed[0] = step == 1
            if armed[0] and point == "start":
                die()
            x, y = rank_micro_batch(batch, rank, world, 0, 1)
            start = time.monotonic()
            loss = engine(x, y)
            engine.backward(loss)
            if armed[0] and point == "reduced":
                die()
            engine.step()
            print(f"STEP {engine.global_steps}", flush=True)
            if armed[0] and point == "publish":
                die()
    except Exception as e:
        print(f"SURVIVOR ERROR after {time.monotonic() - start:.1f}s: {type(e).__name__}: {e}",
              flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
