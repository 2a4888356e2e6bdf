"""engine.offload_states() / reload_states() (DeepSpeed's API): every device state leaves for the
host (the ledger's device tier reads 0, the buffers' storages hold no bytes) and comes back;
training after the round trip equals training without it bit for bit, and, independently, plain
torch's training (SGD: the update shows a gradient's scale)."""
from __future__ import annotations

import pytest
import torch

from harness import run_world
from reference import engine_train, global_batches, reference_train, tiny_gpt

CASES = [
    {"stage": 1},
    {"stage": 2},
    {"stage": 3},
    {"stage": 3, "bf16": True},
    {"stage": 2, "offload": True},
]


def _config(case: dict) -> dict:
    zero = {"stage": case["stage"], "stage3_param_persistence_threshold": 100}
    if case.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
           "optimizer": ({"type": "Adam", "params": {"lr": 1e-3}} if case.get("offload")
                         else {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}})}
    if case.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    return cfg


def _round_trip(rank: int, world: int) -> list[dict]:
    import zerokit
    from zerokit.engine.offload_states import device_buffers

    batches = global_batches(4, 2 * world)
    out = []
    for case in CASES:
        runs = {}
        for trip in (False, True):
            engine, *_ = zerokit.initialize(model=tiny_gpt(), config=_config(case))
            losses = engine_train(engine, batches[:2], rank, world)
            facts = {}
            if trip:
                before = {t: engine.ledger.bytes(t) for t in ("device", "host")}
                buffers = device_buffers(engine)
                engine.offload_states()
                facts = {
                    "device_before": before["device"], "device_between": engine.ledger.bytes("device"),
                    "host_rise": engine.ledger.bytes("host") - before["host"],
                    "freed": all(t.untyped_storage().nbytes() == 0 for _, t in buffers),
                    "kinds": sorted({k for k, _ in buffers}),
                }
                with pytest.raises(RuntimeError, match="call engine.reload_states"):
                    engine(*batches[0])
                engine.reload_states()
                facts["device_after"] = engine.ledger.bytes("device")
            losses += engine_train(engine, batches[2:], rank, world)
            runs[trip] = {"losses": losses, "final": engine.consolidated_fp32_state_dict(), **facts}
            engine.destroy()
        out.append({"case": case, "plain": runs[False], "trip": runs[True]})
    return out


def test_offload_and_reload_every_state_bit_for_bit() -> None:
    sgd = reference_train(tiny_gpt, lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9), global_batches(4, 4))
    for rank_results in run_world(_round_trip, 2, timeout=400):
        for r in rank_results:
            case, plain, trip = r["case"], r["plain"], r["trip"]
            assert trip["device_before"] > 0 and trip["device_between"] == 0, (case, trip)
            assert trip["host_rise"] == trip["device_before"], (case, trip)
            assert trip["device_after"] == trip["device_before"], (case, trip)
            assert trip["freed"], case
            # offload_optimizer keeps the optimizer state on the host already (as in DeepSpeed)
            on_device = {"lp_params"} if case.get("offload") else {"lp_params", "optim_states", "hp_params"}
            assert on_device <= set(trip["kinds"]), (case, trip["kinds"])
            assert trip["losses"] == plain["losses"], case
            for name, v in plain["final"].items():
                assert torch.equal(trip["final"][name], v), (case, name)
            if not case.get("offload") and not case.get("bf16"):
                torch.testing.assert_close(torch.tensor(trip["losses"]), torch.tensor(sgd[0]),
                                           rtol=1e-5, atol=1e-6)
                for name, v in sgd[1].items():
                    torch.testing.assert_close(trip["final"][name], v, rtol=1e-5, atol=1e-6)


def test_offload_states_refuses_what_it_does_not_do() -> None:
    import zerokit

    engine, *_ = zerokit.initialize(model=tiny_gpt(), config=_config({"stage": 2}))
    with pytest.raises(NotImplementedError, match="device='nvme'"):
        engine.offload_states(device="nvme")
    with pytest.raises(ValueError, match=r"include='weights' is not one of|include=.*not one of"):
        engine.offload_states(include=["weights"])
    engine.offload_states(device="none")  # DeepSpeed: nothing happens
    assert engine.ledger.bytes("device") > 0
    engine.reload_states()  # nothing offloaded: a no-op
    engine.destroy()
