"""Config keys that change what the engine does: overlap_comm, fp16.auto_cast (DeepSpeed's meanings)."""
from __future__ import annotations

import torch
import torch.nn as nn

from harness import run_world
from reference import engine_train, global_batches, reference_train, tiny_gpt

STEPS, MICRO, LR = 3, 2, 0.1


def _reductions_in_flight(rank: int, world: int) -> dict:
    """For overlap_comm true and false: how many gradient reductions were still in flight as each
    unit's started, and the training result (SGD: any change in the reduced values shows)."""
    import zerokit
    from zerokit.units.unit import Unit

    outstanding, seen = [0], []
    launch = Unit.launch_reduce

    def counting_launch(unit):
        seen.append(outstanding[0])
        handle = launch(unit)
        outstanding[0] += 1
        wait = handle.wait

        def counted_wait() -> None:
            if not handle.done:
                outstanding[0] -= 1
            wait()
        handle.wait = counted_wait
        return handle
    Unit.launch_reduce = counting_launch
    out = {}
    for overlap in (True, False):
        seen.clear()
        engine, *_ = zerokit.initialize(model=tiny_gpt(), config={
            "train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "zero_optimization": {"stage": 2, "overlap_comm": overlap}})
        losses = engine_train(engine, global_batches(STEPS, MICRO * world), rank, world)
        out[overlap] = {"in_flight": list(seen), "losses": losses,
                        "final": engine.consolidated_fp32_state_dict()}
        engine.destroy()
    Unit.launch_reduce = launch
    return out


def test_overlap_comm_false_waits_for_each_reduction_at_once() -> None:
    ref_losses, ref_weights = reference_train(tiny_gpt, lambda ps: torch.optim.SGD(ps, lr=LR),
                                              global_batches(STEPS, MICRO * 2))
    for r in run_world(_reductions_in_flight, 2):
        assert max(r[True]["in_flight"]) > 0, "overlap_comm=true: reductions should overlap backward"
        assert r[False]["in_flight"] and max(r[False]["in_flight"]) == 0, \
            f"overlap_comm=false: a reduction started while others were in flight: {r[False]['in_flight']}"
        for overlap in (True, False):
            torch.testing.assert_close(torch.tensor(r[overlap]["losses"]), torch.tensor(ref_losses),
                                       rtol=1e-5, atol=1e-6)
            for name, v in ref_weights.items():
                torch.testing.assert_close(r[overlap]["final"][name], v, rtol=1e-5, atol=1e-6)


class _Probe(nn.Module):
    """Records the dtypes its forward receives; computes in its weights' dtype."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 4)

    def forward(self, x, ids, extra=None):
        self.seen = (x.dtype, ids.dtype, None if extra is None else extra.dtype)
        return self.lin(x.to(self.lin.weight.dtype)).float().pow(2).mean() + ids.float().mean() * 0


def _auto_cast(rank: int, world: int) -> dict:
    import zerokit

    out = {}
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
    ids = torch.arange(2)
    for auto_cast in (True, False):
        model = _Probe()
        engine, *_ = zerokit.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "fp16": {"enabled": True, "auto_cast": auto_cast}, "zero_optimization": {"stage": 1}})
        loss = engine(x, ids, extra=x)
        plain = _Probe().half()
        out[auto_cast] = {"seen": model.seen, "loss": loss.detach(),
                          "plain": plain.lin(x.half()).float().pow(2).mean()}
        engine.destroy()
    return out


def test_fp16_auto_cast_casts_floating_positional_inputs_to_half() -> None:
    for r in run_world(_auto_cast, 2):
        # As DeepSpeed's _cast_inputs_half: floating positional inputs only; ints and kwargs stay.
        assert r[True]["seen"] == (torch.float16, torch.int64, torch.float32)
        assert r[False]["seen"] == (torch.float32, torch.int64, torch.float32)
        assert torch.equal(r[True]["loss"], r[True]["plain"])
