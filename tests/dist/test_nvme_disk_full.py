"""A disk that fills mid-run under ZeRO-Infinity (issue #16's faults): a clear error naming the
file, never a wrong number, and the last checkpoint stays loadable. The full disk is real: a
4 MiB tmpfs mounted in a private mount namespace (unshare), filled by another file mid-run; the
worker (nvme_disk_full_worker.py) runs inside it."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from reference import global_batches, reference_train, tiny_gpt

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")
LR, STEPS, MICRO = 1e-3, 3, 2


def _namespace_prefix() -> list[str]:
    """`unshare` arguments giving the worker a mount namespace where it may mount a tmpfs."""
    if shutil.which("unshare") is None:
        pytest.skip("no size-limited filesystem can be made here: `unshare` (util-linux) is missing")
    prefix = ["unshare", "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        prefix[1:1] = ["--user", "--map-root-user"]
    probe = subprocess.run(prefix + ["true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no size-limited filesystem can be made here: {' '.join(prefix)} failed "
                    f"({probe.stderr.strip()})")
    return prefix


def _run(tmp_path, mode: str) -> dict:
    small, roomy, out = tmp_path / "small", tmp_path / "roomy", tmp_path / f"{mode}.pt"
    small.mkdir()
    roomy.mkdir()
    script = (f'mount -t tmpfs -o size=4m tmpfs "$1" && exec "{sys.executable}" '
              f'"{os.path.join(HERE, "nvme_disk_full_worker.py")}" "$@" {mode}')
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(_namespace_prefix() + ["sh", "-c", script, "sh", str(small), str(roomy),
                                                  str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return torch.load(out)


def _expected() -> dict:
    _, weights = reference_train(tiny_gpt, lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=0.1),
                                 global_batches(STEPS, MICRO))
    return weights


def _equal_to_reference(got: dict, want: dict, what: str) -> None:
    for name, w in want.items():  # test_offload.py's fp32 bound for the host kernel
        torch.testing.assert_close(got[name], w, rtol=1e-6, atol=LR * 1e-4,
                                   msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.slow
def test_disk_full_mid_run_fails_the_save_cleanly_and_training_stays_exact(tmp_path) -> None:
    seen = _run(tmp_path, "reserved")
    assert "the disk is full" in seen["save_error"] and "rank00000" in seen["save_error"], seen
    assert "previous checkpoint and 'latest' are untouched" in seen["save_error"]
    assert seen["tags"] == ["global_step1", "latest"], seen["tags"]
    want = _expected()
    _equal_to_reference(seen["continued"], want, "trained on after the failed save")
    _equal_to_reference(seen["resumed"], want, "resumed from the last good checkpoint")


@pytest.mark.slow
def test_disk_full_on_sparse_swap_files_fails_the_step_naming_the_file(tmp_path) -> None:
    seen = _run(tmp_path, "sparse")
    assert "No space left on device" in seen["step_error"], seen
    assert re.search(r"zerokit-swap/rank0-\d+-[0-9a-f]+/\S+\.swp", seen["step_error"]), seen
    # The optimizer state in the files may be half written: no later step may build on it.
    assert "cannot train on" in seen["after_error"] and "load the last checkpoint" in seen["after_error"]
    _equal_to_reference(seen["resumed"], _expected(), "resumed from the last good checkpoint")
