"""One process of tests/dist/test_nvme_disk_full.py, run where `small` is a size-limited
filesystem (a tmpfs in its own mount namespace). argv: small roomy out mode

mode "reserved": the swap files hold their space from the start (posix_fallocate): a disk that
    fills mid-run fails the next checkpoint save cleanly and training goes on, exactly.
mode "sparse": a filesystem without fallocate (swap files are sparse): the first write into a
    hole on a full disk fails the step naming the file, the engine refuses to train on, and the
    last checkpoint resumes exactly.
Writes what it saw to `out` (torch.save) for the test to check.
"""
from __future__ import annotations

import errno
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reference import engine_train, global_batches, tiny_gpt  # noqa: E402

import zerokit  # noqa: E402
from zerokit.checkpoint import CheckpointWriteError  # noqa: E402

STEPS, MICRO, LR = 3, 2, 1e-3


def config(nvme_path: str) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme",
                                                                    "nvme_path": nvme_path}}}


def fill(directory: str) -> None:
    """Another process takes every free byte of the disk."""
    with open(os.path.join(directory, "filler"), "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e


def resume(ckpt: str, roomy: str, batches) -> dict:
    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(7), config=config(roomy))
    engine.load_checkpoint(ckpt)
    engine_train(engine, batches[engine.global_steps:], 0, 1)
    out = engine.consolidated_fp32_state_dict()
    engine.destroy()
    return out


def main() -> None:
    small, roomy, out_path, mode = sys.argv[1:5]
    if mode == "sparse":
        def no_fallocate(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.EOPNOTSUPP, "fallocate is not supported here")
        os.posix_fallocate = no_fallocate
    batches = global_batches(STEPS, MICRO)
    seen: dict = {}
    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config=config(small))
    if mode == "reserved":
        ckpt = os.path.join(small, "ckpt")
        engine_train(engine, batches[:1], 0, 1)
        engine.save_checkpoint(ckpt)
        fill(small)
        try:
            engine.save_checkpoint(ckpt)
        except CheckpointWriteError as e:
            seen["save_error"] = str(e)
        seen["tags"] = sorted(os.listdir(ckpt))
        engine_train(engine, batches[1:], 0, 1)  # the swap files' space was reserved: trains on
        seen["continued"] = engine.consolidated_fp32_state_dict()
    else:
        ckpt = os.path.join(roomy, "ckpt")
        engine.save_checkpoint(ckpt)  # global step 0
        fill(small)
        try:
            engine_train(engine, batches[:1], 0, 1)
        except OSError as e:
            seen["step_error"] = str(e)
        try:
            engine_train(engine, batches[1:2], 0, 1)
        except zerokit.EngineFailedError as e:
            seen["after_error"] = str(e)
    engine.destroy()
    os.unlink(os.path.join(small, "filler"))
    seen["resumed"] = resume(ckpt, roomy, batches)
    torch.save(seen, out_path)


if __name__ == "__main__":
    main()
