"""One rank of the preemption test (tests/dist/test_preemption.py), started as its own process
with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, as a launcher would.

argv: save_dir point signalled_ranks signals steps
  point: where in step 1 SIGTERM arrives: forward | backward | step | between
  signalled_ranks: comma-separated ranks that receive it (a scheduler signals all; "0" tests
  that the others follow); signals: how many SIGTERMs (2: exits at once)
Prints "STEP n" after each completed step (the parent reads how far it got).
"""
from __future__ import annotations

import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reference import global_batches, rank_micro_batch, tiny_gpt  # noqa: E402

import zerokit  # noqa: E402

MICRO, LR = 2, 0.05


def main() -> None:
    save_dir, point, ranks, signals, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    signalled = rank in {int(r) for r in ranks.split(",")}
    model = tiny_gpt()
    engine, optimizer, _, _ = zerokit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MICRO, "comm_timeout_s": 30,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "preemption": {"save_dir": save_dir}})
    armed = [False]

    def term(*_args) -> None:
        if armed[0] and signalled:
            armed[0] = False
            for _ in range(signals):
                os.kill(os.getpid(), signal.SIGTERM)
    if point == "forward":
        model.transformer.h[1].register_forward_pre_hook(term)
    elif point == "backward":
        model.transformer.h[0].mlp.c_fc.weight.register_hook(lambda g: (term(), g)[1])
    elif point == "step":
        optimizer.register_step_pre_hook(term)
    for step, batch in enumerate(global_batches(steps, MICRO * world)):
        armed[0] = step == 1
        if point == "between" and step == 2:
            armed[0] = True
            term()
        x, y = rank_micro_batch(batch, rank, world, 0, 1)
        engine.backward(engine(x, y))
        engine.step()
        print(f"STEP {engine.global_steps}", flush=True)
    print("FINISHED", flush=True)


if __name__ == "__main__":
    main()
