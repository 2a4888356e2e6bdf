"""Run one script body under the real DeepSpeed or under zerokit (answering `import deepspeed`
through its compatibility distribution), at world 1 or 2, and return what rank 0 printed.

The body is plain Python that imports `deepspeed` itself and ends by calling `emit(obj)` with a
JSON-able result; `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` and `OUT` (a fresh directory
shared by the ranks) are in the environment, as torchrun would set them. Each run is a fresh
set of subprocesses: nothing is shared between the two implementations.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

PRELUDE = textwrap.dedent('''
    import json as _json, os as _os

    def emit(obj):
        if int(_os.environ.get("RANK", "0")) == 0:
            print("RESULT " + _json.dumps(obj), flush=True)
''')


def install_compat(target: str) -> str:
    """compat/deepspeed installed into `target` (no network, no build isolation): on a
    subprocess's path first, `import deepspeed` and its package metadata are zerokit's."""
    src = os.path.join(target, "_src", "deepspeed")
    shutil.copytree(os.path.join(REPO, "compat", "deepspeed"), src)  # the build writes beside it
    site = os.path.join(target, "site")
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                          "--no-build-isolation", "--target", site, src],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(out.stdout + out.stderr)
    return site


def real_deepspeed_available() -> bool:
    """True when `import deepspeed` in this environment is DeepSpeed itself (the `bench` extra)."""
    try:
        import importlib.metadata as md
        return "zerokit" not in md.version("deepspeed")
    except Exception:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(body: str, impl: str, world: int, out_dir: str, compat_site: str | None = None,
        timeout: float = 600) -> dict:
    """Run `body` on `world` ranks under `impl` ("deepspeed" or "zerokit", which needs
    `compat_site` from install_compat); return rank 0's emitted JSON. A rank that fails (or
    emits nothing) fails the call with every rank's output tail."""
    if impl not in ("deepspeed", "zerokit"):
        raise ValueError(f"impl={impl!r}: expected 'deepspeed' or 'zerokit'")
    if impl == "zerokit" and compat_site is None:
        raise ValueError("impl='zerokit' needs compat_site (install_compat)")
    os.makedirs(out_dir, exist_ok=True)
    script = os.path.join(out_dir, "_script.py")
    with open(script, "w") as f:
        f.write(PRELUDE + textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DS_ACCELERATOR")}
    path = [os.path.join(REPO, "src")]
    if impl == "zerokit":
        path.insert(0, compat_site)
    else:
        env["DS_ACCELERATOR"] = "cpu"
    env.update(PYTHONPATH=os.pathsep.join(path), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), LOCAL_WORLD_SIZE=str(world), CUDA_VISIBLE_DEVICES="",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", OUT=out_dir, OMP_NUM_THREADS="1")
    procs = []
    for rank in range(world):
        renv = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen([sys.executable, script], env=renv, cwd=out_dir, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            outs.append(p.communicate())
    lines = [line for line in outs[0][0].splitlines() if line.startswith("RESULT ")]
    if any(p.returncode != 0 for p in procs) or not lines:
        tails = "\n".join(f"--- rank {r} rc={p.returncode}\n{o[-3000:]}\n{e[-6000:]}"
                          for r, (p, (o, e)) in enumerate(zip(procs, outs)))
        raise AssertionError(f"{impl} run at world {world} failed:\n{tails}")
    return json.loads(lines[-1][len("RESULT "):])
