"""benchmarks/path_crossings.py (issue #26 point 6): how the traced calls are counted, and one
real trace of this tree (a 256 x 256 Linear, one process, a few seconds)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import path_crossings as P  # noqa: E402


def test_changes_are_counted_per_thread_with_the_io_leaves_left_out():
    calls = {"1": ["parts/a.py", "parts/a.py", "io/aio.py", "units/b.py", "optim/fallback.py",
                   "units/b.py"],
             "2": ["units/b.py", "engine/c.py"]}
    got = P.count(calls)
    assert got["files"] == 3 and got["calls"] == 6
    # thread 1: a a b b -> one change (the leaves between the b's are not a change); thread 2: one
    assert got["changes"] == 2
    assert got["by_file"] == {"parts/a.py": 2, "units/b.py": 3, "engine/c.py": 1}


def test_a_traced_step_crosses_the_reduction_the_part_and_the_kernel(tmp_path):
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    got = P.run_tree(os.path.abspath(src), "step")
    on_the_way = {"units/reduction.py", "parts/nvme.py", "optim/host.py", "engine/engine.py"}
    assert on_the_way <= set(got["by_file"]), sorted(got["by_file"])
    assert not any(f.startswith(P.LEAVES) for f in got["by_file"])
    assert got["changes"] >= got["files"] - 1
