"""Preemption (see [Note: preemption] in engine/preemption.py): SIGTERM at several points of a
step, on every rank or only one, finishes that step on every rank, leaves a checkpoint that loads
and equals the reference after that many steps, and exits with PREEMPTED_EXIT_CODE; a second
SIGTERM ends the process at once."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from harness import run_world
from reference import global_batches, reference_train, tiny_gpt

pytestmark = pytest.mark.robustness

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD, MICRO, LR, STEPS = 2, 2, 0.05, 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(save_dir: str, point: str, ranks: str, signals: int) -> list[tuple[int, str]]:
    """Start WORLD worker processes as a launcher would; (returncode, output) per rank."""
    port = _free_port()
    src = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "preempt_worker.py"), save_dir, point, ranks,
             str(signals), str(STEPS)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    out = []
    deadline = time.monotonic() + 120
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"a preempted world did not end within 120 s")
        out.append((p.returncode, text))
    return out


def _load(rank: int, world: int, save_dirs: list[str]) -> list[tuple[int, dict]]:
    """Each checkpoint in a fresh engine, all in one world (a world per case costs a start-up)."""
    import zerokit

    out = []
    for save_dir in save_dirs:
        engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config={
            "train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
        engine.load_checkpoint(save_dir)
        out.append((engine.global_steps, engine.consolidated_fp32_state_dict()))
        engine.destroy()
    return out


# (point, signalled ranks, the global step the world stops after). SIGTERM in forward or backward
# of step index 1 stops after it (global step 2); in its optimizer update, after the ranks agreed
# for that step, it is acted on at the next step (3); between steps, before index 2, after it (3).
CASES = [("forward", "0,1", 2), ("backward", "0,1", 2), ("step", "0,1", 3), ("between", "0,1", 3),
         ("backward", "0", 2), ("step", "1", 3)]


@pytest.mark.slow
def test_sigterm_at_each_point_saves_a_loadable_checkpoint_and_exits_75(tmp_path) -> None:
    from zerokit import PREEMPTED_EXIT_CODE

    assert PREEMPTED_EXIT_CODE == 75  # documented: docs/robustness.md
    batches = global_batches(STEPS, MICRO * WORLD)
    save_dirs = []
    for point, ranks, stop_after in CASES:
        save_dir = str(tmp_path / f"{point}-{ranks.replace(',', '')}")
        results = _launch(save_dir, point, ranks, 1)
        for rank, (code, text) in enumerate(results):
            assert code == PREEMPTED_EXIT_CODE, f"{point}/{ranks} rank {rank}: exit {code}\n{text}"
            assert "FINISHED" not in text and f"STEP {stop_after - 1}" in text, text
        with open(os.path.join(save_dir, "latest")) as f:
            assert f.read().strip() == f"global_step{stop_after}", point
        save_dirs.append(save_dir)
    loaded = run_world(_load, WORLD, save_dirs)
    for i, (point, ranks, stop_after) in enumerate(CASES):
        _, expected = reference_train(tiny_gpt, lambda p: torch.optim.SGD(p, lr=LR),
                                      batches[:stop_after])
        for per_case in loaded:
            steps, state = per_case[i]
            assert steps == stop_after, (point, steps)
            for name, ref in expected.items():
                torch.testing.assert_close(state[name], ref, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{point}/{ranks} {name}: {m}")


def test_second_sigterm_exits_at_once(tmp_path) -> None:
    results = _launch(str(tmp_path / "twice"), "forward", "0,1", 2)
    for code, text in results:
        assert code == -signal.SIGTERM, f"exit {code}\n{text}"
        assert "STEP 2" not in text, text  # did not finish the step
    assert not os.path.exists(tmp_path / "twice" / "latest")
