"""The daemon's state directory: one daemon at a time.

The state directory (``daemon.state_dir``) holds the store with every node's agent
token, the agent CA's key, the lock and the local instances' working directories.
:func:`state_dir_lock` holds an exclusive ``flock`` on ``spotvisord.lock`` in it, for
the whole life of the process that takes it (``spotvisord run``, ``spotvisord demo``
on both its directories); :func:`serving` is a daemon's claim, taken by
:func:`daemon.interfaces.cli.running_daemon`, so every entry point that runs a daemon
(the benchmarks too) holds the same lock. :func:`prepare_state_dir` makes it 0700.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import Iterator

import structlog

__all__ = ["LOCK_NAME", "StateDirError", "StateDirBusy", "prepare_state_dir", "state_dir_lock", "serving"]

log = structlog.get_logger("spotvisor.state_dir")

LOCK_NAME = "spotvisord.lock"
# process-global: the state directories this process holds the lock of, and those a
# daemon of this process runs on (reset by leaving the context managers)
_locked: set[Path] = set()
_serving: set[Path] = set()


class StateDirError(OSError):
    """The state directory cannot be used; the message is one line with the fix."""


class StateDirBusy(StateDirError):
    """Another process (or another daemon of this one) holds the state directory; the
    message names it and its pid."""


def prepare_state_dir(path: Path) -> Path:
    """Create ``path`` 0700 whatever the umask (missing parents as the umask says), or
    take access for others away from an existing one (a group's, e.g. systemd's
    ``StateDirectoryMode=0750``, is kept). Returns ``path``. Raises ``OSError``: not a
    directory, not writable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path)) from None
        if mode & 0o007:
            os.chmod(path, mode & 0o770)
            log.warning("state_dir_tightened", state_dir=str(path), mode=f"{mode & 0o770:04o}", was=f"{mode:04o}")
    else:
        os.chmod(path, 0o700)  # the umask may have taken bits from mkdir's mode
    return path


@contextlib.contextmanager
def state_dir_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path/spotvisord.lock`` (0600, holding this pid)
    while the block runs; the kernel drops it when the process dies, however it dies.
    Prepares the directory first (:func:`prepare_state_dir`).

    Raises:
        StateDirBusy: another process holds it (the message names its pid), or this
            one does already.
        OSError: the directory cannot be made.
    """
    prepare_state_dir(path)
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise StateDirBusy(f"state directory {path} is in use by another spotvisord (pid {holder}); "
                               "stop that one, or give this one its own daemon.state_dir") from None
        if stat.S_IMODE(os.fstat(fd).st_mode) != 0o600:
            os.fchmod(fd, 0o600)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _locked.add(path)
        try:
            yield
        finally:
            _locked.discard(path)
            os.ftruncate(fd, 0)  # still held: no reader sees a stale pid
    finally:
        os.close(fd)


@contextlib.contextmanager
def serving(path: Path) -> Iterator[Path]:
    """A daemon's claim on its state directory ``path`` for its life: the lock
    (:func:`state_dir_lock`), taken here unless this process holds it already (the
    command line takes it first, to refuse in one line before anything starts).
    Yields ``path``.

    Raises:
        StateDirBusy: another process holds the lock, or another daemon of this
            process runs on ``path``.
        OSError: as :func:`state_dir_lock`.
    """
    if path in _serving:
        raise StateDirBusy(f"state directory {path} is in use by another daemon of this process (pid {os.getpid()}); "
                           "give each daemon its own daemon.state_dir")
    with contextlib.ExitStack() as stack:
        if path not in _locked:
            stack.enter_context(state_dir_lock(path))
        _serving.add(path)
        try:
            yield path
        finally:
            _serving.discard(path)
