"""Crash safety: a rank killed (SIGKILL) at any moment of a save leaves `latest` loadable.

Two ranks save a good tag, then a second save during which one rank kills itself: at named points
of the protocol (mid-write of its shard file, after its marker, before / after the commit's
rename, before `latest` is replaced), and after varied delays while saving in a loop. Then, in
this process, `latest` must load, and a tag that never completed must be refused.

The same again where the second save reuses the tag `latest` names (a run that saves to one tag
name over and over), with two more points: between moving the old copy aside and moving the new
one in, and while removing the old copy. `latest` must still load (either copy, complete), and
a save after the crash must clean up what the killed one left.
"""
from __future__ import annotations

import os
import signal
import tempfile
import threading
import time

import pytest
import torch

from harness import _entry, _ranks_context, run_world
from reference import tiny_gpt
from fast_tier import slow_except

CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 2}, "comm_timeout_s": 10}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _install_kill(point: str, rank: int) -> None:
    import zerokit.checkpoint.save as save

    if point == "mid-write" and rank == 1:
        def partial(path, tensors, metadata):
            with open(path, "wb") as f:
                f.write(b"\0" * 1000)
            _die()
        save.save_shard_file = partial
    elif point == "after-marker" and rank == 1:
        original = save.write_json

        def marker_then_die(path, obj):
            original(path, obj)
            if path.endswith(".done"):
                _die()
        save.write_json = marker_then_die
    elif point in ("before-meta", "before-rename") and rank == 0:
        original_json, original_fsync = save.write_json, save.fsync_dir

        def json_hook(path, obj):
            if point == "before-meta" and path.endswith("meta.json"):
                _die()
            original_json(path, obj)

        def fsync_hook(path):
            if point == "before-rename" and ".tmp-" in path:
                _die()
            original_fsync(path)
        save.write_json, save.fsync_dir = json_hook, fsync_hook
    elif point == "before-latest" and rank == 0:
        save.write_bytes_atomic = lambda path, data: _die()
    elif point == "between-renames" and rank == 0:
        original_rename = os.rename

        def rename_then_die(src, dst):
            original_rename(src, dst)
            if os.path.basename(dst).startswith(".old-"):  # the old copy is aside, the new not in
                _die()
        save.os.rename = rename_then_die
    elif point == "removing-old" and rank == 0:
        original_rmtree = save.shutil.rmtree

        def remove_part_then_die(path, *args, **kwargs):
            if os.path.basename(path).startswith(".old-") and os.path.isdir(path):
                os.remove(os.path.join(path, "meta.json"))  # a partly removed old copy
                _die()
            original_rmtree(path, *args, **kwargs)
        save.shutil.rmtree = remove_part_then_die


def _save_and_die(rank: int, world: int, root: str, point: str, delay: float, reuse: bool = False) -> None:
    import zerokit

    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(0), config=CONFIG)
    x = torch.randint(0, 256, (2, 16))
    engine.backward(engine(x, x))
    engine.step()
    engine.save_checkpoint(root, tag="good")
    engine.backward(engine(x, x))
    engine.step()
    if delay:
        if rank == 1:
            threading.Thread(target=lambda: (time.sleep(delay), _die()), daemon=True).start()
        for i in range(1000):
            engine.save_checkpoint(root, tag="good" if reuse else f"loop{i}")
    else:
        _install_kill(point, rank)
        engine.save_checkpoint(root, tag="good" if reuse else "bad")
    raise AssertionError("the save should have been killed")


class _Discard:
    """The ranks' result channel: the outcome here is the files on disk, not what ranks report."""

    def put(self, item: object) -> None:
        pass


def _run_until_killed(fn, world: int, *args, timeout: float = 60.0) -> list[int]:
    """Like harness.run_world (its forkserver, its rank entry), but a killed world is the
    expected outcome. Returns the ranks' exit codes."""
    ctx = _ranks_context()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_entry, args=(fn, r, world, os.path.join(tmp, "store"), 10.0, _Discard(),
                                                   dict(os.environ), os.getcwd(), args, {}), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        # Once a rank is dead the others can only fail; they are killed too (after a grace
        # period in which they may react), as a preempted job's processes are.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and all(p.exitcode is None for p in procs):
            time.sleep(0.02)
        time.sleep(0.3)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [p.exitcode for p in procs]


def _check_loadable(root: str) -> str:
    import zerokit
    from zerokit.checkpoint import IncompleteCheckpointError

    with open(os.path.join(root, "latest")) as f:
        latest = f.read()
    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(1), config={**CONFIG, "zero_optimization": {"stage": 0}})
    path, client = engine.load_checkpoint(root)
    assert path == os.path.join(root, latest) and client == {}
    engine.destroy()
    for entry in os.listdir(root):
        if entry.startswith(".tmp-"):  # a save that never completed: refused, by name
            with pytest.raises(IncompleteCheckpointError, match="never completed"):
                zerokit.checkpoint.load.read_meta(os.path.join(root, entry[len(".tmp-"):]))
    return latest


@pytest.mark.parametrize("point,delay", slow_except([("mid-write", 0), ("after-marker", 0), ("before-meta", 0),
                                                     ("before-rename", 0), ("before-latest", 0),
                                                     ("", 0.05), ("", 0.15), ("", 0.4)],
                                                    fast=[("mid-write", 0)]))
def test_kill_during_save_leaves_latest_loadable(tmp_path, point: str, delay: float) -> None:
    root = str(tmp_path)
    codes = _run_until_killed(_save_and_die, 2, root, point, delay)
    assert -signal.SIGKILL in codes, f"no rank was killed (exit codes {codes})"
    latest = _check_loadable(root)
    if point:
        assert latest == "good"
        # The interrupted tag is either absent, or (killed after its rename) complete.
        bad = os.path.join(root, "bad")
        assert not os.path.exists(bad) or point == "before-latest"
    else:
        assert latest == "good" or latest.startswith("loop")


REUSE_POINTS = ["mid-write", "after-marker", "before-meta", "before-rename", "between-renames",
                "removing-old", "before-latest"]


def _save_after_crash(rank: int, world: int, root: str) -> list[str]:
    """A resumed run loads `latest`, trains a step and saves the same tag again."""
    import zerokit

    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(0), config=CONFIG)
    engine.load_checkpoint(root)
    x = torch.randint(0, 256, (2, 16))
    engine.backward(engine(x, x))
    engine.step()
    engine.save_checkpoint(root, tag="good")
    engine.destroy()
    return sorted(os.listdir(root))


@pytest.mark.slow
@pytest.mark.parametrize("point,delay", [(p, 0) for p in REUSE_POINTS] + [("", 0.05), ("", 0.15), ("", 0.4)])
def test_kill_while_resaving_the_latest_tag_leaves_it_loadable(tmp_path, point: str, delay: float) -> None:
    import zerokit
    from zerokit.checkpoint.load import read_meta

    root = str(tmp_path)
    codes = _run_until_killed(_save_and_die, 2, root, point, delay, True)
    assert -signal.SIGKILL in codes, f"no rank was killed (exit codes {codes})"
    with open(os.path.join(root, "latest")) as f:
        assert f.read() == "good"
    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(1), config={**CONFIG, "zero_optimization": {"stage": 0}})
    path, client = engine.load_checkpoint(root)  # the old copy or the new one, whichever is whole
    assert client == {} and os.path.basename(path) in ("good", ".old-good"), path
    read_meta(path)
    engine.destroy()
    # The next save of the tag takes over what the killed one left behind.
    left = run_world(_save_after_crash, 2, root)[0]
    assert left == ["good", "latest"], left
    read_meta(os.path.join(root, "good"))
