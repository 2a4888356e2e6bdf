"""Run one script body under the real DeepSpeed and under zerokit's `deepspeed`, side by side.

`run(body, impl, world)` writes `body` to a file and starts `world` processes (gloo on the CPU,
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment, as torchrun sets them). In
the body, `import deepspeed` is the real DeepSpeed 0.19.8 (`impl="deepspeed"`,
DS_ACCELERATOR=cpu) or zerokit's compatibility layer (`impl="zerokit"`: a temporary directory
holding compat/deepspeed's `deepspeed` package is first on the path). The body calls
`emit(obj)` once with what it read; `run` returns every rank's object, rank 0 first. Nothing is
shared between the two runs but the body.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
IMPLS = ("deepspeed", "zerokit")

_PRELUDE = '''\
import json as _json, os as _os, sys as _sys, warnings as _warnings
_warnings.filterwarnings("ignore")
RANK = int(_os.environ["RANK"]); WORLD = int(_os.environ["WORLD_SIZE"])
def emit(obj):
    print("RESULT " + _json.dumps(obj), flush=True)
def _end_group():  # the harness's cleanup: a gloo group alive at exit can abort the process
    import torch.distributed as _dist
    if _dist.is_initialized():
        _dist.barrier()
        _dist.destroy_process_group()
import atexit as _atexit
_atexit.register(_end_group)
'''
_ZEROKIT_SITE: list[str] = []


def real_deepspeed_or_skip() -> None:
    """The comparison needs DeepSpeed itself (zerokit's `bench` extra)."""
    try:
        import deepspeed
    except ImportError:
        pytest.skip("the comparison needs the real DeepSpeed: install zerokit's `bench` extra "
                    "(deepspeed==0.19.8)")
    if "zerokit" in deepspeed.__version__:
        pytest.skip("`import deepspeed` is zerokit's compatibility layer here; the comparison "
                    "needs the real DeepSpeed (the `bench` extra)")


def _zerokit_site() -> str:
    """A directory whose `deepspeed` package is compat/deepspeed's alias of zerokit.compat.deepspeed."""
    if not _ZEROKIT_SITE:
        site = tempfile.mkdtemp(prefix="zk-fidelity-site-")
        shutil.copytree(os.path.join(REPO, "compat", "deepspeed", "src", "deepspeed"),
                        os.path.join(site, "deepspeed"))
        _ZEROKIT_SITE.append(site)
    return _ZEROKIT_SITE[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(body: str, impl: str, world: int = 1, timeout: float = 300, cwd: str | None = None) -> list:
    """Every rank's emitted object (rank 0 first); fails with the ranks' output if one fails."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} (got {impl!r})")
    workdir = cwd or tempfile.mkdtemp(prefix=f"zk-fidelity-{impl}-")
    script = os.path.join(workdir, f"probe_{impl}.py")
    with open(script, "w") as f:
        f.write(_PRELUDE + body)
    path = [os.path.join(REPO, "src")]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DS_ACCELERATOR")}
    if impl == "zerokit":
        path.insert(0, _zerokit_site())
    else:
        env["DS_ACCELERATOR"] = "cpu"
    env.update(PYTHONPATH=os.pathsep.join(path), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               ZK_FIDELITY_DIR=workdir)
    procs = [subprocess.Popen([sys.executable, script], cwd=workdir, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(world)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    if cwd is None:  # the script, its store and its checkpoints: nothing is read afterwards
        shutil.rmtree(workdir, ignore_errors=True)
    results = []
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert p.returncode == 0 and lines, (f"{impl} rank {r} of {world} failed (rc {p.returncode}):"
                                             f"\n{out[-3000:]}\n{err[-6000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results
