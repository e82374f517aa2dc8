"""A process's descendants, read from ``/proc`` (Linux), for the agent's last word to a
trainer that outlived its notice: SIGKILL to torchrun and every worker under it.

``/proc/<pid>/stat`` field 4 is the parent pid (proc(5)); the command name before it is
in parentheses and may itself hold spaces or parentheses, so the fields are read after
the *last* ``)``. Blocking (reads ``/proc``): call it from a thread or a short callback.
"""

from __future__ import annotations

import os
import signal

__all__ = ["parent_of", "descendants", "kill_tree"]


def parent_of(stat: str) -> int | None:
    """The parent pid in the text of a ``/proc/<pid>/stat`` file; None if it cannot be read."""
    _, sep, rest = stat.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 2 or not fields[1].isdigit():
        return None
    return int(fields[1])


def descendants(pid: int, proc: str = "/proc") -> list[int]:
    """Every live descendant of ``pid`` (children first, then theirs), from ``proc``."""
    children: dict[int, list[int]] = {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat")) as f:
                ppid = parent_of(f.read())
        except OSError:  # it exited while we read
            continue
        if ppid is not None:
            children.setdefault(ppid, []).append(int(name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            if child not in out:
                out.append(child)
                todo.append(child)
    return out


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` to ``pid``'s descendants, then to ``pid``; the pids it reached."""
    reached = []
    for target in [*descendants(pid), pid]:  # read before the parent dies: orphans are re-parented
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            continue
        reached.append(target)
    return reached
