"""Event-loop stalls of another process, watched from outside it (Linux ``/proc``).

:class:`LoopWatch` samples one thread of another process (the daemon's main thread,
which runs its asyncio loop) every ``every_s`` from a thread of *this* process, so the
watching costs the watched process nothing. A timer inside the daemon did cost it:
20 ``asyncio.sleep(0.05)`` wake-ups a second measured 3.2-3.5 % of one core on the
bench's 2-core VM, as much as the whole daemon at 1,000 nodes (``bench/README.md``).

A **stall** is a stretch during which the loop's thread never went back to sleep in
``epoll_wait``: between two samples its ``voluntary_ctxt_switches`` did not change
(it never blocked) and at the first of them it was not asleep in the selector. Each
stall is one record ``{"t", "lag_s", "cpu_s", "runq_s"}``: when it began (unix s,
to within one sample), how long it lasted (s), and of that time how much the thread
spent on a CPU (running daemon code) and waiting, runnable, for one (the machine had no
CPU for it), from ``/proc/PID/task/TID/schedstat``; the rest it was blocked in a
system call that is not the selector's (a blocking call on the loop).

Sources (proc(5), https://man7.org/linux/man-pages/man5/proc.5.html):
``/proc/PID/task/TID/stat`` (field 3, the state), ``.../status``
(``voluntary_ctxt_switches``), ``.../syscall`` (the number of the system call the thread
is blocked in, or ``running``; it needs ptrace access to the process, and without it
the state alone tells asleep from running), ``.../schedstat`` (time on a CPU and time
waiting for one, in ns; https://docs.kernel.org/scheduler/sched-stats.html).
"""

from __future__ import annotations

import os
import platform
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["LoopWatch"]

# the selector's system calls (CPython's select.epoll.poll is epoll_wait; glibc may use
# epoll_pwait or epoll_pwait2), by architecture (the kernel's syscall tables)
_EPOLL_SYSCALLS = {"x86_64": {232, 281, 441}, "aarch64": {22, 441}}
_ASLEEP = frozenset("SDI")  # interruptible / uninterruptible sleep, idle kernel wait


@dataclass(frozen=True, slots=True)
class _Sample:
    t: float  # time.time()
    asleep_in_selector: bool
    voluntary: int
    on_cpu_s: float
    runq_s: float


class LoopWatch:
    """Watch thread ``tid`` (default: the main thread, ``pid``) of process ``pid`` for
    stalls longer than ``report_s`` seconds; see the module docstring.

    ``start()`` begins sampling every ``every_s`` seconds on a daemon thread;
    ``stop()`` ends it and returns the stalls, oldest first. A process that has exited
    ends the sampling quietly. Linux only: elsewhere ``start`` raises ``OSError``.
    """

    def __init__(self, pid: int, *, tid: int | None = None, every_s: float = 0.025, report_s: float = 0.05) -> None:
        self.pid, self.tid = pid, tid or pid
        self.every_s, self.report_s = every_s, report_s
        self.stalls: list[dict[str, Any]] = []
        self._epoll = _EPOLL_SYSCALLS.get(platform.machine())
        self._fds: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        base = f"/proc/{self.pid}/task/{self.tid}"
        for name in ("stat", "status", "schedstat"):
            self._fds[name] = os.open(f"{base}/{name}", os.O_RDONLY)
        try:
            self._fds["syscall"] = os.open(f"{base}/syscall", os.O_RDONLY)
            os.pread(self._fds["syscall"], 64, 0)
        except OSError:  # no ptrace access: tell asleep from running by the state alone
            self._fds.pop("syscall", None)
        self._thread = threading.Thread(target=self._run, name="bench-loopwatch", daemon=True)
        self._thread.start()

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        return self.stalls

    def _read(self) -> _Sample:
        t = time.time()
        stat = os.pread(self._fds["stat"], 1024, 0).decode()
        state = stat[stat.rindex(")") + 2]
        asleep = state in _ASLEEP
        if asleep and "syscall" in self._fds and self._epoll is not None:
            first = os.pread(self._fds["syscall"], 64, 0).split(maxsplit=1)[0]
            asleep = first.isdigit() and int(first) in self._epoll
        status = os.pread(self._fds["status"], 4096, 0).decode()
        voluntary = int(status.split("voluntary_ctxt_switches:", 1)[1].split(None, 1)[0])
        on_cpu_ns, runq_ns = os.pread(self._fds["schedstat"], 128, 0).split()[:2]
        return _Sample(t, asleep, voluntary, int(on_cpu_ns) / 1e9, int(runq_ns) / 1e9)

    def _run(self) -> None:
        start: _Sample | None = None  # the sample a stall in progress began at
        prev: _Sample | None = None
        while not self._stop.wait(self.every_s):
            try:
                cur = self._read()
            except (OSError, ValueError, IndexError):  # the process is gone
                return
            busy = prev is not None and not prev.asleep_in_selector and cur.voluntary == prev.voluntary
            if busy and start is None:
                start = prev
            elif not busy and start is not None:
                self._close(start, prev)
                start = None
            prev = cur
        if start is not None and prev is not None:
            self._close(start, prev)

    def _close(self, start: _Sample, end: _Sample | None) -> None:
        if end is None or end.t - start.t <= self.report_s:
            return
        self.stalls.append({"t": start.t, "lag_s": round(end.t - start.t, 4),
                            "cpu_s": round(end.on_cpu_s - start.on_cpu_s, 4),
                            "runq_s": round(end.runq_s - start.runq_s, 4)})
