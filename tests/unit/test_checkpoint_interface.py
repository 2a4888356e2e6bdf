"""The checkpoint package through its narrow interface ([Note: checkpoint interface]).

A `Checkpointable` here is not an Engine: its one unit's fp32 master lives in a plain file, as
state on the NVMe tier will, and is offered as a `FileRange`, to save from and to load into.
"""
from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors import safe_open

from zerokit.checkpoint import load_checkpoint, save_checkpoint, wait_for_checkpoint
from zerokit.checkpoint.consolidate import get_fp32_state_dict
from zerokit.checkpoint.interface import (FileRange, LoadPiece, ParamRecord, SavedOptimizer, SavePiece, SaveState,
                                          UnitRecord)
from zerokit.comm.collectives import Comm
from zerokit.units.lease import ReadLease
from fast_tier import slow_except

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


@pytest.mark.parametrize("module", slow_except(["zerokit.checkpoint", "zerokit.config", "zerokit.config.plan",
                                                 "zerokit.io"], fast=["zerokit.checkpoint"]))
def test_importing_a_part_does_not_import_the_engine(module: str) -> None:
    code = f"import {module}, sys; assert 'zerokit.engine' not in sys.modules, sorted(sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.path.abspath(SRC))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


PARAMS = (("a", (3, 4)), ("b", (20,)))  # 32 elements: one unit, no padding at world 1
NUMEL = 32
HEADER = 96  # the master's bytes start here in its file (an unrelated prefix before them)


class FileBacked:
    """A one-unit model whose master is elements of a file, exp_avg a tensor; world size 1."""

    def __init__(self, path: str, master: torch.Tensor, exp_avg: torch.Tensor, async_save: bool):
        with open(path, "wb") as f:
            f.write(b"\x7f" * HEADER + master.numpy().tobytes() + b"\x7f" * 40)
        self.master = FileRange(path, HEADER, NUMEL, torch.float32)
        self.exp_avg = exp_avg.clone()
        self.comm = Comm()
        self.module = torch.nn.Linear(2, 2)
        self.config = SimpleNamespace(checkpoint=SimpleNamespace(async_save=async_save, tag_validation="WARN"),
                                      zero_optimization=SimpleNamespace(stage=3))
        self.training_dataloader = None
        self.save_lease = ReadLease()
        self.global_steps, self.micro_steps = 7, 7
        self.restored: dict[str, Any] = {}

    def gradient_accumulation_steps(self) -> int:
        return 1

    def wait_for_weights(self) -> None:
        pass

    def checkpoint_units(self) -> list[UnitRecord]:
        params, offset = [], 0
        for name, shape in PARAMS:
            n = int(torch.Size(shape).numel())
            params.append(ParamRecord(name, shape, offset, n))
            offset += n
        return [UnitRecord("u", NUMEL, NUMEL, NUMEL, True, 0, torch.float32, tuple(params))]

    def state_to_save(self) -> SaveState:
        # The master as three segments: a tensor view can't hold it, so the file range is in the middle.
        head = self.master.read()[:5]
        middle = FileRange(self.master.path, HEADER + 5 * 4, 20, torch.float32)
        tail = self.master.read()[25:]
        return SaveState([SavePiece("u/master", (head, middle, tail)), SavePiece("u/optim.exp_avg", (self.exp_avg,))],
                         {"u": ["exp_avg"]}, {"u": {"step": 7}}, None)

    def restore_state(self, fill, optimizer: SavedOptimizer | None) -> None:
        unit = self.checkpoint_units()[0]
        fill(LoadPiece(unit, "values", 0, NUMEL, self.master))
        if optimizer is not None:
            fill(LoadPiece(unit, "optim.exp_avg", 0, NUMEL, self.exp_avg, zero_rest=True))
            self.restored["optimizer"] = optimizer

    def training_scalars(self) -> dict[str, Any]:
        return {"lr_scheduler": None, "loss_scaler": {"scale": 1.0},
                "counters": {"global_steps": 7, "micro_steps": 7, "skipped_steps": 0, "global_samples": 56},
                "param_groups": [{"lr": 0.5}]}

    def restore_training_scalars(self, scalars: dict[str, Any], *, optimizer: bool, lr_scheduler: bool) -> None:
        self.restored["scalars"] = scalars["counters"]


@pytest.mark.parametrize("async_save", [False, True])
def test_file_ranges_save_and_load_through_the_interface(tmp_path, async_save: bool) -> None:
    master = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    exp_avg = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    saver = FileBacked(str(tmp_path / "saver.bin"), master, exp_avg, async_save)
    tag_dir = save_checkpoint(saver, str(tmp_path / "ckpt"), client_state={"k": 1})
    wait_for_checkpoint(saver)
    assert not saver.save_lease.held

    with safe_open(os.path.join(tag_dir, "rank00000.safetensors"), "pt") as f:  # the format as-is
        assert torch.equal(f.get_tensor("u/master"), master)
        assert torch.equal(f.get_tensor("u/optim.exp_avg"), exp_avg)
    fp32 = get_fp32_state_dict(str(tmp_path / "ckpt"))
    assert torch.equal(fp32["a"], master[:12].view(3, 4)) and torch.equal(fp32["b"], master[12:])

    loader = FileBacked(str(tmp_path / "loader.bin"), torch.zeros(NUMEL), torch.zeros(NUMEL), async_save)
    path, client = load_checkpoint(loader, str(tmp_path / "ckpt"))
    assert path == tag_dir and client == {"k": 1}
    raw = open(tmp_path / "loader.bin", "rb").read()
    assert raw[:HEADER] == b"\x7f" * HEADER and raw[HEADER + NUMEL * 4:] == b"\x7f" * 40  # only its range
    assert torch.equal(loader.master.read(), master)
    assert torch.equal(loader.exp_avg, exp_avg)
    saved = loader.restored["optimizer"]
    assert saved.units["u"].keys == ("exp_avg",) and saved.units["u"].scalars == {"step": 7}
    assert saved.launches == 7 and not saved.pending_write_back
    assert loader.restored["scalars"]["global_steps"] == 7


def test_read_lease_holds_until_released_and_reraises() -> None:
    import threading

    lease, go = ReadLease(), threading.Event()
    order: list[str] = []

    def job(release) -> None:
        go.wait()
        order.append("read")
        release()
        raise OSError("disk full")
    lease.start(job, "test-job")
    assert lease.held
    go.set()
    lease.settle()
    order.append("settled")
    assert order == ["read", "settled"]
    with pytest.raises(OSError, match="disk full"):
        lease.wait()
    lease.wait()  # raised once
