"""An engine frees what it made: after `destroy()`, or when simply dropped.

- cycles: 5 initialize / train / (destroy | drop) cycles per configuration (stage 2; stage 2 with
  the offloaded, delayed host update and its worker thread; stage 3; stage 3 built under
  zero.Init with offload_param), on 2 gloo ranks so the heartbeat threads of the engine's and of
  zero.Init's Comm run. Weak references to every model, engine, unit and buffer must be dead
  afterwards, and no zerokit thread may still run. A drop (`del engine, model, optimizer`) must
  free the units' buffers without a gc pass: no reference cycle may hold them.
- a dropped engine whose model the user keeps: the engine is freed at once (hooks on the model
  do not keep it alive); at stage 2 the model keeps working on the trained weights; at stage 3
  its weights were partitioned away, and calling it says so.
"""
from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from harness import run_world
from reference import TINY, global_batches, rank_micro_batch, tiny_gpt

CYCLES = 5
BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
OFFLOAD = {"device": "cpu", "ratio": 0.5, "delayed_update": {"enabled": True, "warmup_steps": 0}}
CASES = {
    "stage2": {"stage": 2},
    "stage2-offload-delayed": {"stage": 2, "offload_optimizer": OFFLOAD},
    "stage2-offload-step-in-backward": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "ratio": 0.5, "step_in_backward": True}},
    "stage3": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "stage3-init-offload": {"stage": 3, "stage3_param_persistence_threshold": 0,
                            "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
}


def _zerokit_threads(wait_s: float = 3.0) -> list[str]:
    """Names of zerokit's threads still alive after up to wait_s (a heartbeat notices its stop
    at once; a host worker finishes the update it runs)."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = [t.name for t in threading.enumerate() if t.name.startswith("zerokit")]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


def _cycle(rank: int, world: int, case: str, mode: str) -> tuple[list, list]:
    """One initialize / train / end cycle. Returns (weak references to what must die, weak
    references to what must die without a gc pass)."""
    import zerokit

    config = {**BASE, "zero_optimization": CASES[case]}
    if case.endswith("init-offload"):
        with zerokit.zero.Init(config=config):
            model = tiny_gpt()
    else:
        model = tiny_gpt()
    engine, optimizer, _, _ = zerokit.initialize(model=model, config=config)
    for batch in global_batches(2, 2 * world):
        x, y = rank_micro_batch(batch, rank, world, 0, 1)
        engine.backward(engine(x, y))
        engine.step()
    if mode == "destroy":
        engine.destroy()
    buffers = [t for u in engine.units for t in (u.flat, u.shard, u.master, u.master_grad, u.grad_flat)
               if t is not None]
    buffers += [p.master for u in engine.units for p in u.parts if p.tier == "host"]
    units = [weakref.ref(u) for u in engine.units]
    everything = [weakref.ref(model), weakref.ref(engine), weakref.ref(optimizer), *units]
    no_gc = units + [weakref.ref(t) for t in buffers]
    del engine, model, optimizer, buffers, batch, x, y
    return everything, no_gc


def _cycles_world(rank: int, world: int) -> dict:
    out = {}
    for case in CASES:
        # Not measured: first calls import lazily (torch's optimizers import torch._dynamo), and
        # an import keeps the frames that called it in a cycle until a gc pass.
        _cycle(rank, world, case, "destroy")
        gc.collect()
        for mode in ("destroy", "drop"):
            alive, alive_without_gc, threads = [], [], []
            for _ in range(CYCLES):
                gc.disable()
                try:
                    refs, no_gc = _cycle(rank, world, case, mode)
                    alive_without_gc.append(sum(r() is not None for r in no_gc))
                finally:
                    gc.enable()
                gc.collect()
                alive.append([type(r()).__name__ for r in refs if r() is not None])
                threads.append(_zerokit_threads())
            out[case, mode] = {"alive": alive, "alive_without_gc": alive_without_gc, "threads": threads}
    return out


@pytest.mark.slow
def test_engines_free_what_they_made() -> None:
    for rank_result in run_world(_cycles_world, 2, timeout=400):
        for (case, mode), r in rank_result.items():
            assert r["alive"] == [[]] * CYCLES, (case, mode, r["alive"])
            assert r["threads"] == [[]] * CYCLES, (case, mode, r["threads"])
            assert r["alive_without_gc"] == [0] * CYCLES, (case, mode, r["alive_without_gc"])


def _train_and_drop_engine(stage: int):
    import zerokit

    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    model = tiny_gpt()
    engine, optimizer, _, _ = zerokit.initialize(model=model, config={**BASE, "zero_optimization": zero})
    batches = global_batches(3, 2)
    for x, y in batches[:2]:
        engine.backward(engine(x, y))
        engine.step()
    trained = engine.consolidated_fp32_state_dict()
    engine_ref = weakref.ref(engine)
    gc.disable()
    try:
        del engine, optimizer
        engine_gone = engine_ref() is None
    finally:
        gc.enable()
    return model, trained, engine_gone, batches[2]


def test_dropped_engine_leaves_a_working_model_at_stage_2() -> None:
    model, trained, engine_gone, (x, y) = _train_and_drop_engine(2)
    assert engine_gone, "hooks on the model kept the dropped engine alive"
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), trained[name], rtol=0, atol=0, msg=name)
    fresh = tiny_gpt(cfg=TINY)
    fresh.load_state_dict({k: v for k, v in trained.items()}, strict=False)
    loss = model(x, y)
    loss.backward()  # no engine hook runs (it would reference the dead engine)
    torch.testing.assert_close(loss, fresh(x, y), rtol=0, atol=0)
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("end", ["drop", "destroy"])
def test_stage3_model_says_it_was_detached(end: str) -> None:
    import zerokit

    if end == "drop":
        model, _, engine_gone, (x, y) = _train_and_drop_engine(3)
        assert engine_gone, "hooks on the model kept the dropped engine alive"
    else:
        model = tiny_gpt()
        engine, *_ = zerokit.initialize(model=model, config={
            **BASE, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
        x, y = global_batches(1, 2)[0]
        engine.destroy()
        del engine
    with pytest.raises(RuntimeError, match="partitioned by a zerokit engine that was (destroyed|dropped)"):
        model(x, y)
