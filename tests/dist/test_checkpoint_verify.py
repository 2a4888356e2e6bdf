"""Saves check themselves (see [Note: self-checking checkpoints] in checkpoint/verify.py): a
snapshot that disagrees with the plan fails the save and leaves `latest`; tag=T loads T; a
truncated shard file and a metadata/file mismatch are refused naming the file."""
from __future__ import annotations

import json
import os

import pytest
import torch

from harness import run_world
from reference import global_batches, rank_micro_batch, tiny_gpt

pytestmark = pytest.mark.robustness

MICRO = 2
CONFIG = {"train_micro_batch_size_per_gpu": MICRO, "comm_timeout_s": 30,
          "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
          "zero_optimization": {"stage": 2}}


def _engine():
    import zerokit

    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config=CONFIG)
    return engine


def _train(engine, rank: int, world: int, steps: int) -> None:
    for batch in global_batches(steps, MICRO * world, seed=engine.global_steps):
        x, y = rank_micro_batch(batch, rank, world, 0, 1)
        engine.backward(engine(x, y))
        engine.step()


def _short_snapshot(rank: int):
    """A snapshot whose first master tensor on rank 1 lacks its last 32 elements: written
    consistently (the writer's sizes agree with what it wrote), but not what the plan says."""
    import zerokit.checkpoint.save as save

    real = save.snapshot

    def short(engine, client_state, copy_tensors):
        snap = real(engine, client_state, copy_tensors)
        if rank == 1:
            name, t = snap.tensors[0]
            snap.tensors[0] = (name, t[:-32] if torch.is_tensor(t) else t[:-1] + [t[-1][:-32]])
        return snap
    return short


def _save_and_load(rank: int, world: int, root: str) -> dict:
    import zerokit.checkpoint.save as save

    engine = _engine()
    _train(engine, rank, world, 1)
    engine.save_checkpoint(root, tag="A")
    weights_a = engine.consolidated_fp32_state_dict()
    _train(engine, rank, world, 1)
    engine.save_checkpoint(root, tag="B")
    out = {}
    real = save.snapshot
    save.snapshot = _short_snapshot(rank)
    try:
        engine.save_checkpoint(root, tag="C")
    except Exception as e:  # noqa: BLE001 - the test inspects it
        out["bad_save"] = f"{type(e).__name__}: {e}"
    finally:
        save.snapshot = real
    with open(os.path.join(root, "latest")) as f:
        out["latest"] = f.read().strip()
    out["c_exists"] = os.path.exists(os.path.join(root, "C"))
    fresh = _engine()
    fresh.load_checkpoint(root, tag="A")  # `latest` names B
    out["steps_a"] = fresh.global_steps
    loaded = fresh.consolidated_fp32_state_dict()
    out["a_equal"] = all(torch.equal(loaded[k], v) for k, v in weights_a.items())
    return out


def test_plan_mismatch_fails_the_save_and_tag_loads_that_tag(tmp_path) -> None:
    for rank, out in enumerate(run_world(_save_and_load, 2, str(tmp_path))):
        assert "bad_save" in out, out
        if rank == 0:  # rank 0 commits and checks; the others hear that the save failed
            assert "CheckpointMismatchError" in out["bad_save"], out
            assert "rank00001.safetensors" in out["bad_save"] and "metadata plans" in out["bad_save"], out
        assert out["latest"] == "B" and not out["c_exists"], out
        assert out["steps_a"] == 1 and out["a_equal"], out


def _load(rank: int, world: int, root: str, tag: str) -> str:
    engine = _engine()
    try:
        engine.load_checkpoint(root, tag=tag)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "loaded"


def _save(rank: int, world: int, root: str) -> None:
    engine = _engine()
    _train(engine, rank, world, 2)
    engine.save_checkpoint(root, tag="T")
    engine.save_checkpoint(root, tag="U")


@pytest.mark.slow
def test_truncated_file_and_metadata_mismatch_are_refused_naming_the_file(tmp_path) -> None:
    root = str(tmp_path)
    run_world(_save, 2, root)
    assert run_world(_load, 2, root, "T") == ["loaded", "loaded"]
    # A truncated shard file (a copy cut short).
    path = os.path.join(root, "T", "rank00001.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    for text in run_world(_load, 2, root, "T"):
        assert "rank00001.safetensors" in text and "Error" in text, text
    # Metadata that disagrees with a file whose size it records correctly: rank 0's saved range
    # of the first unit, edited shorter (as a metadata file from another save would say).
    meta_path = os.path.join(root, "U", "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    lo, hi = meta["units"][0]["ranges"][0]
    meta["units"][0]["ranges"][0] = [lo, hi - 32]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    for text in run_world(_load, 2, root, "U"):
        assert text.startswith("CheckpointMismatchError") and "rank00000.safetensors" in text, text
        assert f"'{meta['units'][0]['name']}/master'" in text, text
