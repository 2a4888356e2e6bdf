"""The side-by-side runner of the DeepSpeed fidelity tests: one script body run under the real
DeepSpeed 0.19.8 or under zerokit answering `import deepspeed`, at world 1 or 2 on gloo.

    results = run(body, "deepspeed" | "zerokit", workdir, world=2)  # what each rank emitted, rank 0 first

Each rank is a fresh interpreter; nothing is shared between the two implementations but the body.
- zerokit's side has compat/deepspeed installed into a temporary directory first on its path (so
  `import deepspeed` and its package metadata, which transformers and Accelerate read, are
  zerokit's), then this tree's src. DeepSpeed's side has neither, and DS_ACCELERATOR=cpu.
- The environment is torchrun's (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
  MASTER_PORT), with no GPU, one OpenMP thread, and transformers offline.
- The body sees `os`, `rank`, `world`, `workdir` (the directory given, shared by the ranks and
  the processes' cwd; a temporary one, removed after the run, when none is given) and `emit(obj)`:
  the last JSON-able object a rank emits is its result, and every rank must emit one.
- The process group: by default the body sets it up as a torchrun script does
  (deepspeed.init_distributed(), the HF Trainer, a file:// rendezvous of its own). With
  join_group=True the ranks join a gloo group through a file store before the body runs, so
  both implementations adopt the same group, and the body also sees `torch`, `dist` and
  `deepspeed`. A group still alive when the body ends is ended (barrier, destroy) at exit.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
IMPLS = ("deepspeed", "zerokit")
_MARK = "ZK_FIDELITY_RESULT "

# The driver each rank runs: the prelude, then the body (its own file, so that tracebacks name
# its lines). __main__'s globals are the body's, as if the body were the script.
_DRIVER = '''\
import atexit as _atexit, json as _json, os, sys as _sys
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
workdir = os.environ["ZK_FIDELITY_WORKDIR"]
_failed = False

def emit(obj):
    import deepspeed as _deepspeed  # the runner checks that the implementation asked for answered
    print({mark!r} + _json.dumps({{"impl": _deepspeed.__version__, "result": obj}}), flush=True)

def _end_group():
    # A gloo group alive at exit can abort the process; the barrier keeps a rank from closing its
    # connections while a peer is still in its last collective. After a failure, the peer may
    # never come: no barrier, the run fails anyway.
    dist = _sys.modules.get("torch.distributed")
    if not _failed and dist is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()

_atexit.register(_end_group)  # first registered, so it runs after the libraries' own exit hooks
if {join_group!r}:
    import datetime as _datetime
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + os.environ["ZK_FIDELITY_STORE"], rank=rank,
                            world_size=world, timeout=_datetime.timedelta(seconds=120))
    import deepspeed
try:
    with open(os.environ["ZK_FIDELITY_BODY"]) as _f:
        exec(compile(_f.read(), os.environ["ZK_FIDELITY_BODY"], "exec"))
except BaseException:
    _failed = True
    raise
'''

_SITE: list[str] = []


def real_deepspeed_or_skip() -> None:
    """Skip unless `import deepspeed` here is DeepSpeed itself (zerokit's `bench` extra)."""
    try:
        import deepspeed
    except ImportError:
        pytest.skip("the comparison needs the real DeepSpeed: install zerokit's `bench` extra "
                    "(deepspeed==0.19.8)")
    if "zerokit" in deepspeed.__version__:
        pytest.skip("`import deepspeed` is zerokit's compatibility layer in this environment; the "
                    "comparison needs the real DeepSpeed (the `bench` extra)")


def zerokit_site() -> str:
    """compat/deepspeed installed (no network, no build isolation) into a directory kept for this
    process: first on a path, `import deepspeed` and its package metadata are zerokit's."""
    if not _SITE:
        root = tempfile.mkdtemp(prefix="zk-fidelity-site-")
        atexit.register(shutil.rmtree, root, True)
        src = os.path.join(root, "src")
        shutil.copytree(os.path.join(REPO, "compat", "deepspeed"), src)  # the build writes beside it
        site = os.path.join(root, "site")
        out = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                              "--no-build-isolation", "--target", site, src],
                             capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise RuntimeError(f"installing compat/deepspeed into {site} failed:\n{out.stdout}{out.stderr}")
        _SITE.append(site)
    return _SITE[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environment(impl: str, world: int, workdir: str, private: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DS_ACCELERATOR")}
    if impl == "zerokit":
        env["PYTHONPATH"] = os.pathsep.join([zerokit_site(), os.path.join(REPO, "src")])
    else:
        env["DS_ACCELERATOR"] = "cpu"
    env.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", ZK_FIDELITY_WORKDIR=workdir,
               ZK_FIDELITY_BODY=os.path.join(private, "body.py"),
               ZK_FIDELITY_STORE=os.path.join(private, "store"))
    return env


def run(body: str, impl: str, workdir: str | os.PathLike | None = None, *, world: int = 1,
        join_group: bool = False, timeout: float = 300) -> list:
    """Run `body` on `world` ranks under `impl`; return each rank's emitted object, rank 0 first.
    A rank that fails, emits nothing, or is still running after `timeout` seconds (then every
    rank is killed) fails the call with every rank's output tail."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} (got {impl!r})")
    if world not in (1, 2):
        raise ValueError(f"world must be 1 or 2 (got {world!r})")
    private = tempfile.mkdtemp(prefix=f"zk-fidelity-{impl}-")  # the driver, the body, the store, logs
    try:
        workdir = os.fspath(workdir) if workdir is not None else os.path.join(private, "work")
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(private, "body.py"), "w") as f:
            f.write(body)
        driver = os.path.join(private, "driver.py")
        with open(driver, "w") as f:
            f.write(_DRIVER.format(mark=_MARK, join_group=join_group))
        env = _environment(impl, world, workdir, private)
        # Output goes to files, not pipes: a rank blocked on a full pipe would stall its peer.
        logs = [(os.path.join(private, f"rank{r}.out"), os.path.join(private, f"rank{r}.err"))
                for r in range(world)]
        procs = []
        for r, (out, err) in enumerate(logs):
            with open(out, "w") as o, open(err, "w") as e:
                procs.append(subprocess.Popen([sys.executable, driver], cwd=workdir, stdout=o, stderr=e,
                                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}))
        timed_out = _wait(procs, timeout)
        texts = []
        for out, err in logs:
            with open(out) as o, open(err) as e:
                texts.append((o.read(), e.read()))
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return _results(impl, world, procs, texts, timeout if timed_out else None)


def _wait(procs: list, timeout: float) -> bool:
    """Wait for every rank; past `timeout` (one deadline for all), kill them all. True if killed."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        return False
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
        return True


def _results(impl: str, world: int, procs: list, texts: list, timed_out: float | None) -> list:
    emitted = [[json.loads(line[len(_MARK):]) for line in out.splitlines() if line.startswith(_MARK)]
               for out, _ in texts]
    if timed_out is not None or any(p.returncode != 0 for p in procs) or not all(emitted):
        why = f"did not finish within {timed_out} s" if timed_out is not None else "failed"
        tails = "\n".join(f"--- rank {r} exit {p.returncode}, emitted {len(e)}\n{o[-3000:]}\n{err[-6000:]}"
                          for r, (p, e, (o, err)) in enumerate(zip(procs, emitted, texts)))
        raise AssertionError(f"{impl} run at world {world} {why}:\n{tails}")
    results = []
    for r, rank_emitted in enumerate(emitted):
        last = rank_emitted[-1]
        assert ("zerokit" in last["impl"]) == (impl == "zerokit"), \
            f"rank {r} of the {impl} run imported deepspeed {last['impl']}"
        results.append(last["result"])
    return results
