"""Which device a rank computes on, with the CUDA facts injected (this machine needs no GPU).

The pure rule is `zerokit.comm.devices.choose_device`; the tests below it drive
`Comm.from_environment` and `initialize` with torch.cuda's answers patched, to check the rule is
applied: set_device before the process group exists, the NCCL group bound to the same device.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zerokit.comm.collectives import Comm

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
LAUNCHER_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
CUDA = torch.device


# ---- the rule, facts injected ------------------------------------------------------------------
def test_cpu_machine_is_unchanged() -> None:
    from zerokit.comm.devices import choose_device

    assert choose_device({}, 0) == CUDA("cpu")
    assert choose_device(TORCHRUN, 0) == CUDA("cpu")
    assert choose_device({}, 0, CUDA("cpu")) == CUDA("cpu")


def test_launcher_uses_local_rank() -> None:
    from zerokit.comm.devices import choose_device

    assert choose_device(TORCHRUN, 2) == CUDA("cuda", 1)
    assert choose_device(dict(TORCHRUN, LOCAL_RANK="0", RANK="0"), 8) == CUDA("cuda", 0)
    # the model on another GPU (built before the launch was known) moves to this rank's GPU
    assert choose_device(TORCHRUN, 2, CUDA("cuda", 0)) == CUDA("cuda", 1)


def test_more_local_ranks_than_gpus_names_both_counts() -> None:
    from zerokit.comm.devices import choose_device

    with pytest.raises(ValueError, match=r"2 local ranks .* 1 CUDA device"):
        choose_device(dict(TORCHRUN, LOCAL_RANK="0", RANK="0"), 1)
    with pytest.raises(ValueError, match=r"4 local ranks .* 2 CUDA device"):
        choose_device(dict(TORCHRUN, LOCAL_RANK="3", LOCAL_WORLD_SIZE="4"), 2)


def test_no_launcher_uses_cuda0_or_the_models_gpu() -> None:
    from zerokit.comm.devices import choose_device

    assert choose_device({}, 1) == CUDA("cuda", 0)
    assert choose_device({}, 1, CUDA("cpu")) == CUDA("cuda", 0)
    assert choose_device({}, 2, CUDA("cuda", 1)) == CUDA("cuda", 1)
    assert choose_device({}, 2, None, current_cuda_index=1) == CUDA("cuda", 1)
    with pytest.raises(ValueError, match="cuda:3"):
        choose_device({}, 2, CUDA("cuda", 3))


def test_existing_group_decides() -> None:
    from zerokit.comm.devices import ExistingGroup, choose_device

    gloo = ExistingGroup("gloo")
    assert choose_device({}, 1, CUDA("cpu"), gloo) == CUDA("cpu")  # a test harness on a GPU machine
    assert choose_device(TORCHRUN, 2, None, gloo) == CUDA("cpu")
    with pytest.raises(ValueError, match=r"'gloo'.*cuda:0"):
        choose_device({}, 1, CUDA("cuda", 0), gloo)
    assert choose_device(TORCHRUN, 2, None, ExistingGroup("nccl")) == CUDA("cuda", 1)
    assert choose_device(TORCHRUN, 2, None, ExistingGroup("nccl", 0)) == CUDA("cuda", 0)
    assert choose_device({}, 2, None, ExistingGroup("cpu:gloo,cuda:nccl"), current_cuda_index=1) \
        == CUDA("cuda", 1)


# ---- applied by Comm.from_environment / initialize ---------------------------------------------
class _FakeCuda:
    """torch.cuda's answers on an n-GPU machine; records set_device and init_process_group calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int, env: dict[str, str]):
        self.calls: list[tuple[str, object]] = []
        for k in LAUNCHER_KEYS:
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: self.calls.append(("set_device", CUDA(d))))
        monkeypatch.setattr(dist, "is_initialized", lambda: False)

        def init_process_group(backend, **kwargs):
            self.calls.append(("init_process_group", (backend, kwargs.get("device_id"))))
            raise _Stop()
        monkeypatch.setattr(dist, "init_process_group", init_process_group)


class _Stop(Exception):
    """Raised by the fake init_process_group: the test has seen what it needs."""


def test_from_environment_without_launcher_on_cuda_uses_cuda0(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeCuda(monkeypatch, 1, {})
    comm = Comm.from_environment(10.0)
    assert comm.device == CUDA("cuda", 0), comm.device
    assert fake.calls == [("set_device", CUDA("cuda", 0))], fake.calls


def test_from_environment_keeps_the_models_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeCuda(monkeypatch, 2, {})
    comm = Comm.from_environment(10.0, model_device=CUDA("cuda", 1))
    assert comm.device == CUDA("cuda", 1), comm.device
    assert fake.calls == [("set_device", CUDA("cuda", 1))], fake.calls


def test_from_environment_under_torchrun_sets_local_rank_before_the_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeCuda(monkeypatch, 2, TORCHRUN)
    with pytest.raises(_Stop):
        Comm.from_environment(10.0)
    assert fake.calls == [("set_device", CUDA("cuda", 1)),
                          ("init_process_group", ("nccl", CUDA("cuda", 1)))], fake.calls


def test_initialize_refuses_more_local_ranks_than_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    import zerokit

    fake = _FakeCuda(monkeypatch, 1, dict(TORCHRUN, RANK="0", LOCAL_RANK="0"))
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"2 local ranks .* 1 CUDA device"):
        zerokit.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert fake.calls == [], fake.calls  # refused before any device or group was touched
    assert model.weight.device.type == "cpu"
