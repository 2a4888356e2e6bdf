"""A process that trained with zerokit leaves with the code it chose (75 after preemption), never
SIGABRT from a native thread unwound at interpreter finalization (see _at_exit in
comm/collectives.py). CI once saw 'terminate called without an active exception' and exit -6
from a preempted rank."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world_exits(code: int) -> list[tuple[int, str]]:
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, os.path.join(HERE, "exit_worker.py"), str(code)],
        env=dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="",
                 PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    return [(p.wait(timeout=120), p.stdout.read()) for p in procs]


@pytest.mark.slow
def test_a_rank_exits_with_its_code_and_no_beat_outlives_the_exit_hooks() -> None:
    # Before the fix one exit in four aborted here; two worlds (four exits) and, deterministically,
    # the count of live heartbeats after the hooks make the test fail on that code.
    for _ in range(2):
        for code, text in _world_exits(75):
            assert code == 75, f"exit {code}\n{text}"
            assert "terminate called" not in text, text
            assert "HEARTBEATS ALIVE AFTER EXIT HOOKS: 0" in text, text
