"""A swap directory of one's own under `<root>/zerokit-swap`, held by a lock while it lives.

[Note: swap directory claims]
Several things may want a rank's swap files under one path at once: a notebook that runs
`initialize` again while the old engine is still referenced, a teacher and a student both built
with zero.Init(remote_device="nvme"), two jobs pointed at the same /local_nvme. Sharing one
`rank<r>` directory, the newcomer's clean-up deleted the live run's files and the old run's
close deleted the newcomer's. So each claim gets its own directory, `rank<r>-<pid>-<hex>`, and
keeps an exclusive flock(2) on its sibling `rank<r>-<pid>-<hex>.lock` for as long as it lives.
flock is per open file, so it holds against claims of the same process too, and the kernel
drops it when the process dies: a lock that can be taken belongs to a dead run.

A starting claim cleans what dead runs of its rank left: directories whose lock it can take,
directories without a lock (the lock is made before its directory and removed after it, so only
the pre-lock layout's `rank<r>` and debris have none), locks without a directory (a release cut
short) and claim files of a run that died while claiming. The lock is taken on a hidden claim
file before its name becomes visible (renamed `<name>.lock`), so a cleaner never finds a live
claim's lock unlocked. Another rank's entries are never touched: ranks start at different
moments and may share the path from different hosts.

`release()` removes the directory, then the lock, then lets go of it, and removes the shared
`zerokit-swap` once it is empty; a claim being made there meanwhile retries (the parent
vanished between its steps).

A claim still held when the interpreter exits normally (a script that never calls
engine.destroy(), the common case) is released then, by one atexit handler over the live
claims: the swap files are scratch, never needed by a later run (checkpoints copy what they
hold), and the docs promise they go. A killed process leaves them to the next claim's clean-up.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import logging
import os
import secrets
import shutil
import weakref

from zerokit.io.aio import warn_once

SWAP_DIR = "zerokit-swap"
_LOCK = ".lock"
_CLAIM = ".claim"


_LIVE: "weakref.WeakSet[SwapDirectory]" = weakref.WeakSet()  # claims not yet released


@atexit.register
def _release_at_exit() -> None:
    for claim in list(_LIVE):
        claim.release()


class SwapDirectory:
    """`path`: a new, empty directory under `<root>/zerokit-swap` owned until `release()`;
    `stale_files`: the names of the files dead runs of this rank left there, removed now."""

    def __init__(self, root: str, rank: int, *, error=OSError):
        # error(errno, what, path): the exception type callers expect (AioError for the tiers).
        self._error = error
        self.parent = os.path.join(os.path.abspath(os.fspath(root)), SWAP_DIR)
        self.prefix = f"rank{rank}"
        self._fd = -1
        self._make_parent()
        self.stale_files = _clean_stale(self.parent, self.prefix)
        self.name, self._fd = self._claim()
        self.path = os.path.join(self.parent, self.name)
        self.lock_path = self.path + _LOCK
        _LIVE.add(self)

    def _make_parent(self) -> None:
        for _ in range(100):
            try:
                os.makedirs(self.parent, exist_ok=True)
                return
            except FileNotFoundError:  # a step's directory vanished as another claim left it
                continue
            except OSError as e:
                raise self._error(e.errno, "creating the swap directory", self.parent) from None
        raise self._error(errno.ENOENT, "creating the swap directory", self.parent)

    def _claim(self) -> tuple[str, int]:
        # Name collisions are near impossible; the parent vanishing (another claim's release
        # removing it while empty) happens once per leaving claim. Both are bounded all the same.
        collisions = vanished = 0
        while collisions < 100 and vanished < 10000:
            # The pid keeps names apart between processes of one host, the hex within one.
            name = f"{self.prefix}-{os.getpid()}-{secrets.token_hex(4)}"
            path = os.path.join(self.parent, name)
            claim = os.path.join(self.parent, f".{name}{_CLAIM}")
            try:
                fd = os.open(claim, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                collisions += 1
                continue
            except FileNotFoundError:  # another claim's release removed the empty parent
                vanished += 1
                self._make_parent()
                continue
            except OSError as e:
                raise self._error(e.errno, "creating the swap directory in", self.parent) from None
            if os.path.lexists(path + _LOCK) or os.path.lexists(path):
                collisions += 1
                os.close(fd)
                _unlink(claim)
                continue
            try:
                _lock_new_file(fd, self.parent)
                os.write(fd, f"pid {os.getpid()}\n".encode())
                os.rename(claim, path + _LOCK)
                os.mkdir(path)
            except FileNotFoundError:  # a cleaner took the claim file for a dead run's: again
                vanished += 1
                os.close(fd)
                _unlink(path + _LOCK)
                continue
            except OSError as e:
                os.close(fd)
                _unlink(claim)
                _unlink(path + _LOCK)
                raise self._error(e.errno, "creating the swap directory", path) from None
            return name, fd
        raise self._error(errno.EEXIST if collisions else errno.ENOENT,
                          "finding a free swap directory name in", self.parent)

    def release(self) -> None:
        """Remove the directory and the lock, then let go of it; idempotent."""
        if self._fd < 0:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        _unlink(self.lock_path)
        os.close(self._fd)
        self._fd = -1
        try:  # the shared parent goes when the last claim leaves it
            os.rmdir(self.parent)
        except OSError:
            pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _lock_new_file(fd: int, parent: str) -> None:
    """flock a file nobody else has opened yet. A filesystem without file locks still gets a
    directory of its own (its name is unique); only cleaning after dead runs is lost there,
    since no lock then tells a dead run from a live one."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in _NO_LOCKS:
            raise
        warn_once(f"swap-no-locks:{parent}",
                  f"no file locks under {parent!r} ({os.strerror(e.errno)}): swap directories "
                  f"that dead runs leave there are not removed at start; remove them by hand")


def _take_if_dead(lock_path: str) -> int:
    """An fd holding `lock_path`'s lock when no live claim holds it, else -1."""
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except OSError:  # gone: its owner released it meanwhile
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return -1
    return fd


def _clean_stale(parent: str, prefix: str) -> list[str]:
    """Remove what dead runs of this rank left under `parent`; returns the files' names."""
    try:
        entries = set(os.listdir(parent))
    except OSError:
        return []
    stale: list[str] = []
    for entry in sorted(entries):
        path = os.path.join(parent, entry)
        if entry.startswith(f".{prefix}-") and entry.endswith(_CLAIM):
            fd = _take_if_dead(path)  # a run that died while claiming
            if fd >= 0:
                _unlink(path)
                os.close(fd)
            continue
        mine = entry == prefix or entry.startswith(prefix + "-")
        if not mine or entry.endswith(_LOCK) or not os.path.isdir(path):
            continue
        fd = -1
        if entry + _LOCK in entries or os.path.lexists(path + _LOCK):
            fd = _take_if_dead(path + _LOCK)
            if fd < 0:
                continue  # a live claim's (or just released)
        stale += sorted(_files_under(path))
        shutil.rmtree(path, ignore_errors=True)
        if fd >= 0:
            _unlink(path + _LOCK)
            os.close(fd)
    for entry in sorted(entries):  # locks whose directory is gone: a release cut short
        orphan = entry.endswith(_LOCK) and entry[:-len(_LOCK)] not in entries
        if entry.startswith(prefix + "-") and orphan:
            fd = _take_if_dead(os.path.join(parent, entry))
            if fd >= 0:
                _unlink(os.path.join(parent, entry))
                os.close(fd)
    if stale:
        logging.getLogger("zerokit").warning(
            "nvme: removing %d swap file(s) a previous run left in %s (%s%s)", len(stale),
            parent, ", ".join(stale[:3]), ", ..." if len(stale) > 3 else "")
    return stale


def _files_under(path: str) -> list[str]:
    return [f for _, _, files in os.walk(path) for f in files]
