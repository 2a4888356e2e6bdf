"""Offload plans are checked against the host's available memory before anything is allocated:
the planned bytes are the bytes the placement really allocates, and a plan that cannot fit is
refused with the numbers."""
from __future__ import annotations

import pytest
import torch

from reference import tiny_gpt

MICRO = 2


def _config(stage: int, dtype: str, offload: dict | None, param: bool = False,
            opt: str = "AdamW") -> dict:
    zero = {"stage": stage}
    if offload is not None:
        zero["offload_optimizer"] = {"device": "cpu", **offload}
    if param:
        zero["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": MICRO, "bf16": {"enabled": dtype == "bf16"},
            "optimizer": {"type": opt, "params": {"lr": 1e-2}}, "zero_optimization": zero}


def _recording(monkeypatch) -> list:
    from zerokit.engine import host_budget

    needs = []
    check = host_budget.check_host_memory

    def record(need, placement, *a, **k):
        needs.append(need)
        return check(need, placement, *a, **k)

    monkeypatch.setattr(host_budget, "check_host_memory", record)
    return needs


PLANS = [  # stage, dtype, offload_optimizer, offload_param, optimizer
    (1, "fp32", {}, False, "AdamW"),
    (2, "bf16", {"ratio": 0.5, "delayed_update": {"enabled": True, "warmup_steps": 0}}, False,
     "AdamW"),
    (3, "fp32", {}, True, "AdamW"),       # the host update writes the host shard in place
    (3, "bf16", {}, True, "Adagrad"),
    (3, "bf16", None, True, "AdamW"),     # weights only
]


@pytest.mark.parametrize("stage,dtype,offload,param,opt", PLANS)
def test_planned_host_bytes_are_the_allocated_ones(monkeypatch, stage, dtype, offload, param, opt):
    import zerokit

    needs = _recording(monkeypatch)
    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(0),
                                         config=_config(stage, dtype, offload, param, opt))
    x = torch.randint(0, 256, (MICRO, 16))
    engine.backward(engine(x, x))
    engine.step()  # the optimizer state exists from here
    planned = sum(n.total for n in needs)
    assert planned > 0 and planned == engine.ledger.bytes(tier="host"), engine.memory_report()
    engine.destroy()


def test_a_plan_the_host_cannot_hold_is_refused_with_the_numbers(monkeypatch) -> None:
    import zerokit
    from zerokit.engine import host_budget
    from zerokit.engine.host_budget import HostMemoryError, size

    needs = _recording(monkeypatch)
    # the plan stepping in step() (stepping in backward turns itself off where it does not fit:
    # tests/dist/test_step_in_backward.py)
    plain = {"step_in_backward": False}
    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(0), config=_config(2, "fp32", plain))
    need = needs[0].total
    engine.destroy()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(host_budget, "available_host_bytes", lambda: (3 * need, "cgroup memory.max"))
    with pytest.raises(HostMemoryError) as e:
        zerokit.initialize(model=tiny_gpt(0), config=_config(2, "fp32", plain))
    message = str(e.value)
    for part in (f"{size(need)} of host memory per rank", "x 4 rank(s) on this machine",
                 f"{size(3 * need)} is available (cgroup memory.max)",
                 "offload_optimizer.ratio (now 1)", "master", "grads", "state"):
        assert part in message, message
    # Half the shard on the host fits in the same memory.
    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(0),
                                         config=_config(2, "fp32", {"ratio": 0.5, **plain}))
    engine.destroy()
