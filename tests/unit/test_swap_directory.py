"""Swap directory claims (io/swap_directory.py): what a dead run left, what a live one holds."""
import errno
import os

import pytest

from zerokit.io import swap_directory
from zerokit.io.swap_directory import SWAP_DIR, SwapDirectory


def test_debris_of_dead_claims_is_removed_and_live_claims_kept(tmp_path):
    parent = tmp_path / SWAP_DIR
    parent.mkdir()
    (parent / ".rank0-1-dead.claim").write_text("pid 1\n")  # died while claiming
    (parent / "rank0-1-cut.lock").write_text("pid 1\n")     # died while releasing: no directory
    (parent / "rank0-1-old").mkdir()                        # died while running
    (parent / "rank0-1-old.lock").write_text("pid 1\n")
    (parent / "rank0-1-old" / "u0_master.swp").write_bytes(b"x")
    live = SwapDirectory(str(tmp_path), 0)
    with open(os.path.join(live.path, "mine.swp"), "wb") as f:
        f.write(b"y")
    second = SwapDirectory(str(tmp_path), 0)
    assert second.stale_files == [] and live.stale_files == ["u0_master.swp"]
    assert sorted(os.listdir(parent)) == sorted(
        [live.name, live.name + ".lock", second.name, second.name + ".lock"])
    second.release()
    live.release()
    assert not parent.exists()


def test_without_file_locks_claims_stay_apart_and_nothing_is_cleaned(tmp_path, monkeypatch):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(swap_directory.fcntl, "flock", no_locks)
    with pytest.warns(RuntimeWarning, match="no file locks"):
        first = SwapDirectory(str(tmp_path), 0)
    second = SwapDirectory(str(tmp_path), 0)
    assert first.path != second.path and os.path.isdir(first.path)
    assert second.stale_files == []  # first's lock cannot be taken: it may be alive
    first.release()
    second.release()
    assert not (tmp_path / SWAP_DIR).exists()


def test_an_unusable_root_is_an_error_naming_it(tmp_path):
    root = tmp_path / "file"
    root.write_text("")
    with pytest.raises(OSError) as ei:
        SwapDirectory(str(root), 0)
    assert str(root) in str(ei.value) and "swap directory" in str(ei.value)
