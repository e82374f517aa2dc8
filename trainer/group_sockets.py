"""The sockets this process's process groups opened, so a blocked collective can be failed.

gloo gives no way to interrupt a collective blocked on a live peer: neither its
``destroy`` nor its ``abort`` closes a connection (torch 2.13). The loss watch
(:class:`trainer.membership.LossWatch`) shuts down the group's connected sockets
instead, and the blocked read fails at once. Which sockets those are is recorded here
as each group is made: every group, not only the default one. DeepSpeed runs its
collectives on a clone of the world group (``deepspeed.utils.groups._clone_world_group``:
``dist.new_group`` of every rank), and FSDP2's device mesh makes groups of its own; a
rank blocked in one of those was not woken when only the default group's sockets were
known (seen in the suite: the DeepSpeed loss cell's rank 0 sat 61 s in its collective,
until the pg timeout).

A socket is recorded as (descriptor, inode): a descriptor the group closed (gloo
closes a pair whose peer is gone) can be reused at once by another socket, a store
client say, which must never be shut. :func:`live` returns only descriptors that still
name the socket recorded (seen in the suite: a survivor's own store client, opened on
a reused descriptor while its watch was waking it, was shut, and its round failed with
"Broken pipe").

How: :func:`track` wraps ``torch.distributed.distributed_c10d._new_process_group_helper``,
through which ``init_process_group``, ``new_group`` and ``new_subgroups`` make each
group (torch 2.13), and records the sockets that appear during each call. A socket
another thread opens meanwhile is recorded too (a store client of the loss watch's
own, a storage connection): shutting it fails one request, which its owner retries.
Where torch has no such helper, :func:`recording` around our own
``init_process_group`` calls still records the default group. Linux only
(``/proc/self/fd``); elsewhere nothing is recorded and nothing is shut.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["socket_inodes", "recording", "track", "making_group", "live"]

_lock = threading.Lock()
_recorded: dict[int, int] = {}  # descriptor → inode of a socket a process group opened
_tracking = False


def socket_inodes() -> dict[int, int]:
    """This process's open socket descriptors and each one's inode (``/proc/self/fd``
    links read ``socket:[INODE]``); empty where there is no ``/proc``."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor among them)
        if link.startswith("socket:["):
            out[int(name)] = int(link[8:-1])
    return out


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Record the sockets opened while the block runs (a process group being made)."""
    before = socket_inodes()
    try:
        yield
    finally:
        new = {fd: ino for fd, ino in socket_inodes().items() if before.get(fd) != ino}
        with _lock:
            _recorded.update(new)


def track() -> None:
    """Record the sockets of every process group this process makes from now on
    (idempotent). A torch without ``_new_process_group_helper``: nothing is wrapped."""
    global _tracking
    from torch.distributed import distributed_c10d as c10d

    with _lock:
        if _tracking or not callable(getattr(c10d, "_new_process_group_helper", None)):
            return
        helper = c10d._new_process_group_helper

        @functools.wraps(helper)
        def recorded_helper(*args: Any, **kwargs: Any) -> Any:
            with recording():
                return helper(*args, **kwargs)

        c10d._new_process_group_helper = recorded_helper
        _tracking = True


def making_group() -> contextlib.AbstractContextManager[None]:
    """Around our own ``init_process_group`` calls: :func:`track` first, then
    :func:`recording` only where it could not wrap torch's helper (the helper records
    exactly the group's sockets; the block would also hold the store client
    ``init_process_group`` makes for ``env://``)."""
    track()
    return contextlib.nullcontext() if _tracking else recording()


def live() -> set[int]:
    """The descriptors that still name a socket a process group opened (stale records,
    closed or reused descriptors, are dropped)."""
    now = socket_inodes()
    with _lock:
        for fd in [fd for fd, ino in _recorded.items() if now.get(fd) != ino]:
            del _recorded[fd]
        return set(_recorded)
