"""A rank SIGKILLed at any point of a stage-2 step, with both cores busy, makes its peer stop
within a bound, naming the dead rank (issue #29: a survivor was once still alive 300 s later)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.robustness

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")
BOUND_S = 60  # the survivor's error, after the kill (comm_timeout_s is 600 in the worker)
POINTS = ["start", "forward", "backward", "reduced", "step", "publish"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _busy_cores() -> list[subprocess.Popen]:
    """A spinning process per core: the ranks run on a loaded machine."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 1)]


def _world(point: str, victim: int) -> list[tuple[int | str, str, float]]:
    port = _free_port()
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "kill_worker.py"), point,
                               str(victim)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    out = []
    deadline = time.monotonic() + 240
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
            out.append((p.returncode, text, time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            text, _ = p.communicate()
            out.append(("hung", text, time.monotonic()))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_at_any_point_of_a_loaded_step_stops_its_peer_naming_it(victim: int) -> None:
    busy = _busy_cores()
    try:
        for point in POINTS:
            results = _world(point, victim)
            dead_code, dead_text, dead_at = results[victim]
            code, text, ended = results[1 - victim]
            where = f"kill of rank {victim} at '{point}'"
            assert dead_code == -9, f"{where}: the victim exited {dead_code}\n{dead_text}"
            assert code != "hung", f"{where}: the survivor was still alive after 240 s\n{text}"
            assert code == 3 and "SURVIVOR ERROR" in text, f"{where}: exit {code}\n{text}"
            took = float(text.split("SURVIVOR ERROR after ")[1].split("s:")[0])
            assert took < BOUND_S, f"{where}: the survivor took {took:.0f}s\n{text}"
            assert f"rank(s) [{victim}] stopped responding" in text, f"{where}:\n{text}"
    finally:
        for p in busy:
            p.kill()
            p.wait()
