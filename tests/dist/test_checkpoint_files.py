"""Checkpoint files: consolidation, torn tags, disk full, asynchronous save."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from harness import run_world
from reference import tiny_gpt

MICRO = 2


def _config(stage: int, dtype: str = "fp32", **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "bf16": {"enabled": dtype == "bf16"}, "zero_optimization": {"stage": stage}, **extra}


def _model(frozen: bool):
    model = tiny_gpt(0)
    if frozen:  # a frozen unit has no master: its weights are what is saved
        model.transformer.wpe.weight.requires_grad_(False)
    return model


def _steps(engine, rank: int, n: int) -> None:
    g = torch.Generator().manual_seed(rank)
    for _ in range(n):
        x = torch.randint(0, 256, (MICRO, 16), generator=g)
        engine.backward(engine(x, x))
        engine.step()


CONSOLIDATE = [(2, "bf16", False), (3, "fp32", True)]


def _train_and_save(rank: int, world: int, root: str) -> dict:
    import zerokit

    out = {}
    for stage, dtype, frozen in CONSOLIDATE:
        engine, _, _, _ = zerokit.initialize(model=_model(frozen), config=_config(stage, dtype))
        _steps(engine, rank, 3)
        engine.save_checkpoint(os.path.join(root, f"s{stage}"))
        out[stage] = engine.consolidated_fp32_state_dict()
        engine.destroy()
    return out


def test_consolidation(tmp_path) -> None:
    from safetensors.torch import load_file

    import zerokit
    from zerokit.cli import main
    from zerokit.checkpoint.zero_to_fp32 import (get_fp32_state_dict_from_zero_checkpoint,
                                            load_state_dict_from_zero_checkpoint)

    trained = run_world(_train_and_save, 2, str(tmp_path))[0]
    for stage, dtype, frozen in CONSOLIDATE:
        ckpt = str(tmp_path / f"s{stage}")
        sd = get_fp32_state_dict_from_zero_checkpoint(ckpt)
        for name, w in trained[stage].items():
            assert torch.equal(sd[name], w), f"stage {stage}: {name}"
        # Into a plain nn.Module (strict: every parameter, alias and buffer is there).
        model = load_state_dict_from_zero_checkpoint(tiny_gpt(9), ckpt)
        for name, p in model.named_parameters():
            assert torch.equal(p, trained[stage][name]), name
        # zerokit convert: sharded safetensors + index in Hugging Face's layout, and one file.
        out = tmp_path / f"hf{stage}"
        assert main(["convert", ckpt, str(out), "--dtype", "bf16", "--max-shard-size", str(20_000 / 2**30)]) == 0
        index = json.loads((out / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
        merged = {}
        for f in files:
            merged.update(load_file(str(out / f)))
        assert set(merged) == set(index["weight_map"])
        for name, w in merged.items():
            assert torch.equal(w, trained[stage][name].to(torch.bfloat16)), name
        assert main(["convert", ckpt, str(tmp_path / f"one{stage}")]) == 0
        single = load_file(str(tmp_path / f"one{stage}" / "model.safetensors"))
        missing, unexpected = tiny_gpt(9).load_state_dict(single, strict=False)
        assert missing == ["lm_head.weight"] and not unexpected  # tied: stored once, as HF does
    # A frozen stage-3 checkpoint loads into one rank at stage 1, frozen parameter included.
    engine, _, _, _ = zerokit.initialize(model=_model(True), config=_config(1))
    engine.load_checkpoint(str(tmp_path / "s3"))
    for name, w in engine.consolidated_fp32_state_dict().items():
        assert torch.equal(w, trained[3][name]), name
    engine.destroy()


def test_torn_tag_is_refused(tmp_path) -> None:
    import zerokit
    from zerokit.checkpoint import IncompleteCheckpointError

    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(0), config=_config(1))
    for tag in ("a", "b", "c", "d"):
        engine.save_checkpoint(str(tmp_path), tag=tag)
    os.remove(tmp_path / "b" / "rank00000.safetensors")
    with open(tmp_path / "c" / "rank00000.safetensors", "r+b") as f:
        f.truncate(100)
    os.remove(tmp_path / "d" / "meta.json")
    os.rename(tmp_path / "a", tmp_path / ".tmp-e")
    cases = {"b": "rank00000.safetensors is missing", "c": "rank00000.safetensors has 100 bytes",
             "d": "meta.json is missing", "e": "never completed"}
    for tag, message in cases.items():
        with pytest.raises(IncompleteCheckpointError, match=message):
            engine.load_checkpoint(str(tmp_path), tag=tag)
    with pytest.raises(IncompleteCheckpointError):  # `latest` names d: refused, not worked around
        engine.load_checkpoint(str(tmp_path))
    assert engine.load_checkpoint(str(tmp_path / "nothing")) == (None, None)  # DeepSpeed: no latest
    engine.destroy()


DISK_FULL = textwrap.dedent("""
    import os, resource, signal, sys
    sys.path.insert(0, {tests!r})
    import torch, zerokit
    from reference import tiny_gpt
    from zerokit.checkpoint import CheckpointWriteError
    root = {root!r}
    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(0), config={config!r})
    engine.save_checkpoint(root, tag="good")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)        # EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    try:
        engine.save_checkpoint(root, tag="bad")
    except CheckpointWriteError as e:
        print("ERROR:", e)
    else:
        print("no error")
""")


@pytest.mark.slow
def test_disk_full_is_a_clean_error(tmp_path) -> None:
    import zerokit

    root = str(tmp_path / "ckpt")
    tests = os.path.dirname(os.path.dirname(__file__))
    script = DISK_FULL.format(tests=tests, root=root, config=_config(2))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ERROR: checkpoint save failed writing" in proc.stdout and "file size limit" in proc.stdout, proc.stdout
    assert "previous checkpoint" in proc.stdout
    assert sorted(os.listdir(root)) == ["good", "latest"]  # the partial tag is gone
    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(1), config=_config(2))
    path, _ = engine.load_checkpoint(root)
    assert path.endswith("good")
    engine.destroy()


def _async(rank: int, world: int, root: str) -> dict:
    import zerokit
    from zerokit.checkpoint import wait_for_checkpoint

    from zerokit.checkpoint import save as save_module

    # The writer reads the live master and optimizer state (no host copy): a slow disk must make
    # the next step wait for it rather than let the step change what is being written.
    write_rank = save_module.write_rank
    save_module.write_rank = lambda *a, **k: (time.sleep(0.5), write_rank(*a, **k))[1]
    cfg = _config(1, "bf16", checkpoint={"async_save": True})
    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(0), config=cfg)
    _steps(engine, rank, 2)
    expected = engine.consolidated_fp32_state_dict()
    engine.save_checkpoint(root, client_state={"k": 2})  # returns before the files are written
    _steps(engine, rank, 1)                              # changes the masters in place
    later = engine.consolidated_fp32_state_dict()
    engine.save_checkpoint(root)                         # waits for the previous save first
    wait_for_checkpoint(engine)
    engine.destroy()
    out = {}
    for tag, want in (("global_step2", expected), ("global_step3", later)):
        engine, _, _, _ = zerokit.initialize(model=tiny_gpt(1), config=cfg)
        _, client = engine.load_checkpoint(root, tag=tag)
        got = engine.consolidated_fp32_state_dict()
        out[tag] = (client, all(torch.equal(got[k], want[k]) for k in want), engine.global_steps)
        engine.destroy()
    return out


def test_async_save(tmp_path) -> None:
    for result in run_world(_async, 2, str(tmp_path)):
        assert result["global_step2"] == ({"k": 2}, True, 2)
        assert result["global_step3"] == ({}, True, 3)
    assert (tmp_path / "latest").read_text() == "global_step3"


def test_markers_appear_only_whole(tmp_path, monkeypatch) -> None:
    """Rank 0 polls for the other ranks' `.done` markers during an async save: a marker must never
    exist half written (it did: rank 0 once read an empty marker and failed the commit)."""
    from zerokit.checkpoint import storage

    marker = tmp_path / "rank00001.done"
    visible_before_durable = []
    fsync = os.fsync

    def checking_fsync(fd):
        visible_before_durable.append(marker.exists())
        return fsync(fd)
    monkeypatch.setattr(os, "fsync", checking_fsync)
    storage.write_json(str(marker), {"files": {"rank00001.safetensors": 123}})
    assert visible_before_durable == [False]
    assert json.loads(marker.read_text()) == {"files": {"rank00001.safetensors": 123}}
    assert os.listdir(tmp_path) == ["rank00001.done"]


def _load_fails_on_one_rank(rank: int, world: int, root: str) -> dict:
    import zerokit

    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(0), config=_config(3))
    engine.save_checkpoint(os.path.join(root, "shared"), tag="t")
    engine.save_checkpoint(os.path.join(root, "shared"), tag="u")
    out = {}
    cases = {  # what each rank is asked to load
        "missing tag": ("shared", "t" if rank == 0 else "gone"),
        "latest only on rank 0": ("shared" if rank == 0 else "empty", None),
        "different tags": ("shared", "t" if rank == 0 else "u"),
    }
    for case, (directory, tag) in cases.items():
        t0 = time.monotonic()
        try:
            engine.load_checkpoint(os.path.join(root, directory), tag=tag)
            out[case] = ("loaded", time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - the message is the result
            out[case] = (f"{type(e).__name__}: {e}", time.monotonic() - t0)
    # The engine is still usable: nothing was half-loaded, the collectives are in step.
    _, client = engine.load_checkpoint(os.path.join(root, "shared"), tag="t")
    out["after"] = client
    engine.destroy()
    return out


def test_a_load_failing_on_one_rank_stops_every_rank_at_once(tmp_path) -> None:
    r0, r1 = run_world(_load_fails_on_one_rank, 2, str(tmp_path), comm_timeout=60.0)
    assert "does not exist" in r1["missing tag"][0]
    assert "rank(s) [1] could not open the checkpoint" in r0["missing tag"][0]
    assert "rank(s) [1] found no 'latest'" in r0["latest only on rank 0"][0]
    assert "found no 'latest'" in r1["latest only on rank 0"][0]
    for r in (r0, r1):
        assert "resolved different tags" in r["different tags"][0]
        assert all(seconds < 20 for _, seconds in list(r.values())[:3])  # not the 60 s timeout
        assert r["after"] == {}
