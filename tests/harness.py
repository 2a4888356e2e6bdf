"""Run a function on N gloo ranks on this CPU: file-store rendezvous, per-rank tracebacks, timeouts.

    results = run_world(fn, world_size, *args)   # fn(rank, world_size, *args) -> picklable

Ranks are forked from a server that imported torch and zerokit once (a fresh process each, in
a tenth of a second); a grid of cases still reads best inside one call. A rank that raises fails the call with that rank's traceback; a world that does
not finish within `timeout` is killed and fails with the ranks that were still running.
"""
from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class WorldFailed(AssertionError):
    pass


def _entry(fn: Callable, rank: int, world_size: int, store_path: str, comm_timeout: float,
           queue: Any, environ: dict, cwd: str, args: tuple, kwargs: dict) -> None:
    # A forked rank starts with the fork server's environment and directory: take the caller's,
    # as a spawned one would (a test's monkeypatch.setenv must reach its ranks).
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    # These are CPU worlds (gloo): on a machine with a GPU, zerokit would otherwise choose it
    # for a launcher-less rank while the test feeds CPU batches and compares with a CPU reference.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    os.environ["ZEROKIT_TEST_RANK"] = str(rank)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=comm_timeout))
        result = fn(rank, world_size, *args, **kwargs)
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException as e:  # report every failure, including SystemExit from the code under test
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


_context = None


def _ranks_context():
    """Ranks start by forking a server that imported torch and zerokit once (forkserver), not by
    spawning interpreters that each import them again: seconds saved per world, and each rank is
    still a fresh process (the server never ran a torch op or started a thread)."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(["torch", "torch.distributed", "zerokit",
                                         "zerokit.engine.engine", "harness", "reference"])
    return _context


# The C library reads these when a process starts: a rank forked from the server would keep the
# server's settings, so a caller that sets one (a memory test fixing malloc's mmap threshold)
# gets ranks spawned afresh.
_READ_AT_PROCESS_START = ("MALLOC_", "GLIBC_TUNABLES")


def run_world(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0,
              comm_timeout: float = 60.0, **kwargs: Any) -> list[Any]:
    at_start = any(k.startswith(_READ_AT_PROCESS_START) for k in os.environ)
    ctx = mp.get_context("spawn") if at_start else _ranks_context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, store_path, comm_timeout, queue,
                                                   dict(os.environ), os.getcwd(), args, kwargs), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: list[str] = []
        import queue as queue_mod
        import time
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            try:
                rank, status, payload = queue.get(timeout=max(0.1, min(remaining, 1.0)))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in results]
                if dead and all(procs[r].exitcode is not None for r in dead):
                    reported = {int(e.split(":", 1)[0][5:]) for e in errors if e.startswith("rank ")}
                    for r in dead:
                        if r not in reported:
                            errors.append(f"rank {r}: exited with code {procs[r].exitcode} without a report")
                            reported.add(r)
                if remaining <= 0:
                    running = [r for r in range(world_size) if r not in results]
                    for p in procs:
                        p.kill()
                    raise WorldFailed(f"world of {world_size} timed out after {timeout}s; "
                                      f"ranks without result: {running}\n" + "\n".join(errors))
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank}: {payload}")
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if errors:
            raise WorldFailed("\n".join(sorted(errors)))
        return [results[r] for r in range(world_size)]
