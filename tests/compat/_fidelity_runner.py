"""Run one script body through the real DeepSpeed or through zerokit's `import deepspeed`.

    results = run_script(body, "deepspeed" | "zerokit", tmp_path, world=1 | 2)  # one dict per rank

Each rank is a fresh interpreter. The preamble joins a gloo group through a file store (no ports)
before the body runs, so both implementations adopt the same process group, and gives the body
`rank`, `world`, `workdir` (a directory shared by the ranks of one run) and `emit(dict)`; the
last dict a rank emits is its result. zerokit's run puts compat/deepspeed/src (the distribution
that makes `import deepspeed` mean zerokit) and this tree's src first on the path; DeepSpeed's
run has neither, with DS_ACCELERATOR=cpu. Nothing is shared between the two runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

PREAMBLE = '''
import json, os, sys, datetime
import torch, torch.distributed as dist
rank, world, workdir = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["FIDELITY_DIR"]
dist.init_process_group("gloo", init_method="file://" + os.path.join(workdir, "store"), rank=rank,
                        world_size=world, timeout=datetime.timedelta(seconds=120))
torch.set_num_threads(1)
import deepspeed
def emit(result):
    print("RESULT " + json.dumps({"impl": deepspeed.__version__, **result}), flush=True)
'''


def real_deepspeed() -> None:
    """Skip unless the real DeepSpeed (the `bench` extra) is importable in this environment."""
    try:
        import deepspeed
    except ImportError:
        pytest.skip("the comparison needs the real DeepSpeed: install zerokit's `bench` extra "
                    "(deepspeed==0.19.8)")
    if "zerokit" in deepspeed.__version__:
        pytest.skip("`import deepspeed` is zerokit's compatibility layer in this environment")


def run_script(body: str, impl: str, tmp_path, world: int = 1, timeout: float = 300) -> list[dict]:
    if impl not in ("deepspeed", "zerokit"):
        raise ValueError(f"impl must be 'deepspeed' or 'zerokit' (got {impl!r})")
    workdir = os.path.join(str(tmp_path), impl)
    os.makedirs(workdir, exist_ok=True)
    script = os.path.join(workdir, "script.py")
    with open(script, "w") as f:
        f.write(PREAMBLE + textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DS_ACCELERATOR")}
    env.update(WORLD_SIZE=str(world), FIDELITY_DIR=workdir, CUDA_VISIBLE_DEVICES="",
               MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    if impl == "zerokit":
        env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "compat", "deepspeed", "src"),
                                             os.path.join(REPO, "src")])
    else:
        env["DS_ACCELERATOR"] = "cpu"
    procs = [subprocess.Popen([sys.executable, script], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    results = []
    for r, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"{impl} rank {r} did not finish within {timeout} s") from None
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, (f"{impl} rank {r} failed (exit {proc.returncode}):\n"
                                                f"{out[-3000:]}\n{err[-6000:]}")
        result = json.loads(lines[-1][len("RESULT "):])
        assert ("zerokit" in result["impl"]) == (impl == "zerokit"), result["impl"]
        results.append(result)
    return results
