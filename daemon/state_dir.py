"""The daemon's state directory: one owner, one daemon, nothing planted followed.

The state directory (``daemon.state_dir``) holds the store with every node's agent
token, the agent CA's key, the lock and the local instances' working directories. It
is trusted only as far as it is the daemon's own:

- **Owned by the daemon's effective uid** and writable by nobody else once set up:
  :func:`prepare_state_dir` refuses a directory another user owns (root included: a
  root daemon never takes over a user's directory) and takes group and world write
  (and all of the world's access) away from an existing one; a new one is 0700.
  From then on only this uid can add or replace an entry in it.
- **One daemon**: :func:`state_dir_lock` holds an exclusive ``flock`` on
  ``spotvisord.lock`` in it, for the whole life of the process that takes it
  (``spotvisord run``, ``spotvisord demo`` on both its directories);
  :func:`serving` is a daemon's claim, taken by
  :func:`daemon.interfaces.cli.running_daemon`, so every entry point that runs a
  daemon (the benchmarks too) holds the same lock.
- **Nothing followed**: an entry left there before it was the daemon's alone (a
  symbolic link, a FIFO, a second hard link, another user's file) is refused, never
  followed, truncated or chmodded. :func:`open_private` opens a file with
  ``O_NOFOLLOW`` and checks what it opened; :func:`check_private` looks
  (``lstat``) at a file something else opens (SQLite's database and its ``-wal``
  and ``-shm``); :func:`private_dir` makes or checks a directory inside.

Every refusal is a :class:`UnsafeStatePath`, an :class:`OSError` whose message is one
line naming the path and the fix.
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

__all__ = ["LOCK_NAME", "StateDirError", "StateDirBusy", "UnsafeStatePath", "prepare_state_dir", "state_dir_lock",
           "serving", "open_private", "check_private", "private_dir", "chmod_private", "clear_stale_socket",
           "chmod_socket", "write_private"]

log = structlog.get_logger("spotvisor.state_dir")

LOCK_NAME = "spotvisord.lock"
# the bits a state directory may keep: the owner's, and a group's read and search
# (systemd's StateDirectoryMode=0750)
_DIR_KEEP = ~0o027

# process-global: the state directories this process holds the lock of, and those a
# daemon of this process runs on (reset by leaving the context managers)
_locked: set[Path] = set()
_serving: set[Path] = set()


class StateDirError(OSError):
    """The state directory cannot be used; the message is one line with the fix."""


class StateDirBusy(StateDirError):
    """Another process (or another daemon of this one) holds the state directory; the
    message names it and its pid."""


class UnsafeStatePath(StateDirError):
    """A path in (or the) state directory is not the daemon's own: a symbolic link, a
    FIFO or other non-regular file, a second hard link, another user's."""


_KINDS = {stat.S_IFLNK: "a symbolic link", stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO",
          stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device"}


def _not_ours(path: Path, st: os.stat_result, *, want_dir: bool) -> str | None:
    """Why ``st`` (an lstat or fstat of ``path``) is not a private entry, or None."""
    fmt = stat.S_IFMT(st.st_mode)
    if fmt != (stat.S_IFDIR if want_dir else stat.S_IFREG):
        kind = _KINDS.get(fmt, "not a regular file")
        if fmt == stat.S_IFLNK:
            return "is a symbolic link"
        return f"is {kind}, not a directory" if want_dir else f"is {kind}, not a regular file"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this daemon's uid {os.geteuid()}"
    if not want_dir and st.st_nlink != 1:
        return f"has {st.st_nlink} hard links"
    return None


def _unsafe(path: Path, why: str, fix: str = "give another daemon.state_dir") -> UnsafeStatePath:
    return UnsafeStatePath(f"{path} {why}; spotvisord never follows or takes over an entry it did not make: "
                           f"remove it (the daemon makes its own), or {fix}")


def prepare_state_dir(path: Path) -> Path:
    """Create ``path`` 0700 whatever the umask (missing parents as the umask says), or
    make an existing one the owner's: group and world write and the world's access
    taken away (a group's read and search, e.g. systemd's ``StateDirectoryMode=0750``,
    is kept). Returns ``path``.

    Raises:
        UnsafeStatePath: ``path`` is a symbolic link, or another uid owns it (nothing
            is changed then).
        OSError: not a directory, cannot be made.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
        made = True
    except FileExistsError:
        made = False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _unsafe(path, "is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise UnsafeStatePath(f"{path} is owned by uid {st.st_uid}, not by this daemon's uid {os.geteuid()}: "
                                  f"if it is this daemon's, chown -R {os.geteuid()} {path}; else give another "
                                  "daemon.state_dir")
        mode = stat.S_IMODE(st.st_mode)
        if made:
            os.fchmod(fd, 0o700)  # the umask may have taken bits from mkdir's mode
        elif mode & ~_DIR_KEEP:
            os.fchmod(fd, mode & _DIR_KEEP)
            log.warning("state_dir_tightened", state_dir=str(path), mode=f"{mode & _DIR_KEEP:04o}", was=f"{mode:04o}")
    finally:
        os.close(fd)
    return path


@contextlib.contextmanager
def state_dir_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path/spotvisord.lock`` (0600, holding this pid)
    while the block runs; the kernel drops it when the process dies, however it dies.
    Prepares the directory first (:func:`prepare_state_dir`).

    Raises:
        StateDirBusy: another process holds it (the message names its pid), or this
            one does already.
        UnsafeStatePath: the directory or the lock file is not the daemon's own.
        OSError: the directory cannot be made.
    """
    prepare_state_dir(path)
    fd = open_private(path / LOCK_NAME, os.O_RDWR | os.O_CREAT)
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
        UnsafeStatePath, OSError: as :func:`state_dir_lock`.
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


def open_private(path: Path, flags: int, mode: int = 0o600) -> int:
    """``os.open(path, flags, mode)`` that never follows a symbolic link and opens only
    a regular file this uid owns with one link; returns the descriptor (close-on-exec).
    ``flags`` may not hold ``O_TRUNC`` (truncate with ``os.ftruncate`` once it is
    open: a refused file is never truncated). A FIFO is opened non-blocking, so it is
    refused, not waited on.

    Raises:
        UnsafeStatePath: a symbolic link, a FIFO or other non-regular file, another
            uid's file, a second hard link.
        FileNotFoundError: missing and ``O_CREAT`` not given. OSError: as ``os.open``.
    """
    if flags & os.O_TRUNC:
        raise ValueError("open_private: no O_TRUNC (truncate once the file is checked)")
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _unsafe(path, "is a symbolic link") from None
        if exc.errno == errno.ENXIO:  # a FIFO opened for writing with no reader
            raise _unsafe(path, "is a FIFO, not a regular file") from None
        raise
    try:
        why = _not_ours(path, os.fstat(fd), want_dir=False)
        if why is not None:
            raise _unsafe(path, why)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private(path: Path, data: bytes, *, atomic: bool = False) -> None:
    """Write ``path`` (0600) in the state directory, never through a planted link; with
    ``atomic``, through a temporary file renamed over it (a reader sees the old or the new)."""
    target = path.with_name(path.name + ".tmp") if atomic else path
    fd = open_private(target, os.O_WRONLY | os.O_CREAT)
    with os.fdopen(fd, "wb") as f:
        f.truncate(0)
        f.write(data)
        if atomic:
            f.flush()
            os.fsync(f.fileno())
    if atomic:
        os.replace(target, path)


def check_private(path: Path) -> bool:
    """Whether ``path`` exists, for a file something else opens (SQLite's): False when
    missing, True when it is a regular file this uid owns with one link.

    Raises:
        UnsafeStatePath: anything else there (a symbolic link is not followed).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    why = _not_ours(path, st, want_dir=False)
    if why is not None:
        raise _unsafe(path, why)
    return True


def chmod_private(path: Path, mode: int) -> None:
    """Give the existing private file ``path`` (:func:`check_private`) ``mode``, not
    following a symbolic link. Raises :class:`UnsafeStatePath` as that; ``OSError``."""
    if not check_private(path):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
    if stat.S_IMODE(os.lstat(path).st_mode) == mode:
        return
    try:
        os.chmod(path, mode, follow_symlinks=False)
    except NotImplementedError:  # glibc before 2.32: checked a moment ago, in a directory only this uid writes
        os.chmod(path, mode)


def private_dir(path: Path, *, root: Path, mode: int = 0o700) -> Path:
    """Make ``path`` (under ``root``, the state directory, which must exist) and the
    directories between them, each ``mode`` when new; each one there already must be
    a real directory this uid owns. Returns ``path``.

    Raises:
        UnsafeStatePath: a symbolic link or another uid's entry on the way.
        ValueError: ``path`` is not under ``root``. OSError: cannot be made.
    """
    here = root
    for part in path.relative_to(root).parts:
        here = here / part
        try:
            here.mkdir(mode=mode)
            os.chmod(here, mode)  # the umask may have taken bits; just made, nobody else writes here
            continue
        except FileExistsError:
            pass
        st = os.lstat(here)
        why = _not_ours(here, st, want_dir=True)
        if why is not None:
            raise _unsafe(here, why)
        if stat.S_IMODE(st.st_mode) & 0o022:  # from before it was the daemon's alone
            os.chmod(here, stat.S_IMODE(st.st_mode) & ~0o022, follow_symlinks=False)
    return path


def clear_stale_socket(path: Path) -> None:
    """Remove the socket a killed daemon left at ``path`` (the control socket) before
    binding there again; nothing to do when missing.

    Raises:
        UnsafeStatePath: something other than a socket is there (a symbolic link is
            not followed, a file not removed).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        why = "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a socket"
        raise _unsafe(path, why, "set another daemon.socket")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def chmod_socket(path: Path, mode: int) -> None:
    """Give the socket just bound at ``path`` ``mode``, never through a symbolic link
    swapped in meanwhile. Raises :class:`UnsafeStatePath` when it is not a socket."""
    try:
        os.chmod(path, mode, follow_symlinks=False)
        return
    except NotImplementedError:  # a link there, or glibc before 2.32
        pass
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise _unsafe(path, "is not the socket just bound", "set another daemon.socket")
    os.chmod(path, mode)
