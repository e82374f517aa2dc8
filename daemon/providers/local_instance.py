"""What a local instance is, outside the daemon that launched it.

The first process of every local instance is a small init (:data:`INSTANCE_INIT`), the
"VM" its node agent runs on; :func:`kill_instance_processes` ends one as a reclaimed VM.
By default the instances end with the daemon (the init watches a pipe only the daemon
writes). Under an outside runner (``spotvisord demo`` with a ``kill_daemon`` or
``kill_control_node`` chaos action, :mod:`daemon.interfaces.demo_runner`) the runner
holds that pipe's write end instead and hands the daemon the read end
(:data:`LIFELINE_FD_ENV`): the instances outlive the daemon, as a cloud's do, and end
with the runner. Each such instance then serves its own metadata endpoint
(:mod:`daemon.providers.local_metadata.serve`) and leaves an :class:`InstanceRecord` in its
node directory, ``<state_dir>/nodes/<node_id>/instance.json``, from which the next
daemon's provider adopts it (:func:`live_records`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import structlog

from daemon.state_dir import StateDirError, open_private, write_private

__all__ = ["INSTANCE_ENV", "INSTANCE_INIT", "LIFELINE_FD_ENV", "STORE_PID_FILE_ENV", "RECORD_FILE", "ADMIN_TOKEN_FILE",
           "InstanceRecord", "kill_instance_processes", "live_records", "outer_lifeline_fd", "process_alive",
           "wait_gone"]

log = structlog.get_logger("spotvisor.provider.local")

#: the read end of the instances' lifeline, an inherited descriptor an outside runner
#: passes the daemon (its number, in this variable); unset: the daemon holds the lifeline
LIFELINE_FD_ENV = "SPOTVISOR_LOCAL_LIFELINE_FD"
#: the file holding the pid of the rendezvous store the runner started last (it restarts the
#: store after a kill: :class:`daemon.controlnode.rendezvous.RunnerStore`), for the chaos
#: ``kill_store`` and ``kill_control_node``
STORE_PID_FILE_ENV = "SPOTVISOR_DEMO_STORE_PID_FILE"
#: an instance's registry record and its metadata endpoint's admin token, in its node directory
RECORD_FILE = "instance.json"
ADMIN_TOKEN_FILE = "metadata-admin.token"

INSTANCE_ENV = "SPOTVISOR_LOCAL_INSTANCE_ID"

# The first process of every local instance
# (``python -c INSTANCE_INIT WATCH_FD META_FD N META_ARGV[N] ARGV...``), its "init": the VM
# the node agent runs on. With N > 0 it first starts ``python META_ARGV...``, the instance's
# own metadata endpoint, which inherits META_FD (its listening socket; the init closes its
# copy), then ``python ARGV...`` (the agent); it ends the whole instance (SIGKILL to every process of it, as a reclaimed VM) as soon as
# one of these happens:
#
# - end of file on WATCH_FD, the read end of a pipe whose write end only the daemon holds
#   (it is close-on-exec there, and every child the daemon starts gets only the fds it is
#   passed): the kernel closes it when the daemon dies, however it dies; or, with an outside
#   runner (:data:`LIFELINE_FD_ENV`), when that runner dies;
# - the agent exits (the provider then lists the instance gone: nothing of it may train on);
# - SIGTERM, SIGHUP or SIGINT (the metadata endpoint sends SIGTERM at a notice's deadline).
#
# Once every descendant is gone it removes the instance's own TMPDIR (``spotvisor-vm-*``,
# made by the provider), as a VM's /tmp goes with the VM.
#
# It is the instance's child subreaper (PR_SET_CHILD_SUBREAPER): a process of the instance
# whose parent dies (torchrun's workers run in sessions of their own) is re-parented to it,
# never to the system's init, so "every process of the instance" is exactly its
# descendants, and it reaps them. Standard library and psutil only: it starts in ~50 ms.
INSTANCE_INIT = r"""
import ctypes, os, selectors, signal, sys
import psutil

watch_fd, meta_fd, n_meta = map(int, sys.argv[1:4])
meta_argv, argv = sys.argv[4:4 + n_meta], sys.argv[4 + n_meta:]
os.set_inheritable(watch_fd, False)
try:
    if ctypes.CDLL(None, use_errno=True).prctl(36, *map(ctypes.c_ulong, (1, 0, 0, 0))) != 0:  # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
except (AttributeError, OSError) as exc:  # not Linux: orphans of the instance are not found after the daemon
    print(f"spotvisor local instance: no child subreaper ({exc})", file=sys.stderr, flush=True)
ending = []
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)  # every signal below wakes the select
signal.signal(signal.SIGCHLD, lambda *_: None)
for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(sig, lambda signum, _: ending.append(signum))
if meta_argv:  # the instance's metadata endpoint: the only child that inherits META_FD
    os.posix_spawn(sys.executable, [sys.executable, *meta_argv], os.environ,
                   setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
if meta_fd >= 0:
    os.close(meta_fd)
agent = os.posix_spawn(sys.executable, [sys.executable, *argv], os.environ,
                       setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))  # as subprocess's restore_signals
status = None
sel = selectors.DefaultSelector()
sel.register(watch_fd, selectors.EVENT_READ)
sel.register(wake_r, selectors.EVENT_READ)
while status is None and not ending:
    for key, _ in sel.select():
        if key.fd == watch_fd:
            if not os.read(watch_fd, 512):
                ending.append("daemon gone")
        else:
            os.read(wake_r, 512)
    while True:  # reap the agent, and any orphan of the instance re-parented here
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        if pid == agent:
            status = st
me = psutil.Process()
while True:  # the instance ends: kill every descendant, reap, until none is left
    for proc in me.children(recursive=True):
        try:
            proc.kill()
        except psutil.Error:
            pass
    try:
        pid, st = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    if pid == agent and status is None:
        status = st
tmp = os.environ.get("TMPDIR", "")
if os.path.basename(tmp).startswith("spotvisor-vm-"):  # the instance's own /tmp (the provider made it): gone with it
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)
code = os.waitstatus_to_exitcode(status) if status is not None else 128 + signal.SIGKILL
sys.exit(code if code >= 0 else 128 - code)
"""


def kill_instance_processes(root_pid: int, instance_id: str) -> list[psutil.Process]:
    """SIGKILL every process of a local instance at once, as a VM being reclaimed; returns
    those signalled (a SIGKILLed process may run on a moment: :func:`wait_gone`). Blocking
    (it reads every process's environment): call it off the event loop.

    torchrun starts its workers in sessions of their own (``start_new_session``),
    so killing the instance's process group is not enough: collect the instance
    init's descendants and any process carrying this instance's id in its
    environment (orphans re-parented to the system's init, should the instance's
    own have died first), then kill them all.
    """
    victims: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(root_pid)
        victims[root.pid] = root
        victims.update((c.pid, c) for c in root.children(recursive=True))
    except psutil.NoSuchProcess:
        pass
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid in victims or proc.pid == me:
            continue
        try:
            if proc.environ().get(INSTANCE_ENV) == instance_id:
                victims[proc.pid] = proc
        except (psutil.Error, OSError):
            continue
    for proc in victims.values():
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    return list(victims.values())



def wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait, up to ``timeout_s`` seconds, until none of ``procs`` runs; returns those that
    still do. A zombie runs nothing and counts as gone (its parent may be gone too, and an
    init that never reaps would keep it for good: ``psutil.wait_procs`` waits for it to
    leave the process table). Blocking: call it off the event loop."""
    deadline = time.monotonic() + timeout_s
    alive = list(procs)
    while True:
        alive = [p for p in alive if _runs(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)  # a poll of the kernel's process table: no event tells of another process's end


def _runs(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def outer_lifeline_fd() -> int | None:
    """The lifeline's read end an outside runner passed this process (:data:`LIFELINE_FD_ENV`),
    or None: the daemon holds the lifeline itself.

    Raises:
        ValueError: the variable is set but names no open pipe here.
    """
    raw = os.environ.get(LIFELINE_FD_ENV)
    if raw is None:
        return None
    try:
        fd = int(raw)
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            raise ValueError("not a pipe")
    except (ValueError, OSError) as exc:
        raise ValueError(f"{LIFELINE_FD_ENV}={raw!r} names no inherited pipe here ({exc})") from None
    return fd


def process_alive(pid: int, create_time: float) -> bool:
    """Whether ``pid`` is still the process that started at ``create_time`` (psutil's
    seconds): a pid reused by another process, a zombie or no process is not."""
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - create_time) < 1e-3 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass(frozen=True, slots=True)
class InstanceRecord:
    """What a new daemon needs to adopt a running local instance (times: unix s).

    ``pid`` and ``create_time`` (psutil's) name its init: the instance lives while that
    process does, and a pid since reused by another process is not it. ``imds_url``: its
    metadata endpoint (the admin token is in :data:`ADMIN_TOKEN_FILE` beside the record).
    ``offer``: the offer's fields (:class:`daemon.control.offers.Offer`). ``gpus``: the
    ``CUDA_VISIBLE_DEVICES`` it was given (:mod:`daemon.providers.local_gpus`), or None.
    """

    id: str
    node_id: str
    pool: str
    pid: int
    create_time: float
    imds_url: str
    dialect: str
    offer: dict[str, Any]
    launched_at: float
    gpus: str | None = None  # its CUDA_VISIBLE_DEVICES when the provider pinned GPUs to it
    tmp: str | None = None  # its own TMPDIR (removed when it ends)

    def write(self, workdir: Path) -> None:
        """Write it, atomically, as ``workdir/instance.json`` (0600)."""
        write_private(workdir / RECORD_FILE, json.dumps(dataclasses.asdict(self)).encode(), atomic=True)

    @classmethod
    def read(cls, path: Path) -> "InstanceRecord | None":
        """The record at ``path``; None (logged) when missing, unsafe or not a record."""
        try:
            fd = open_private(path, os.O_RDONLY)
            with os.fdopen(fd, "rb") as f:
                raw = json.loads(f.read(65536))
            return cls(**{f.name: raw[f.name] for f in dataclasses.fields(cls)
                          if f.name in raw or f.default is dataclasses.MISSING})  # KeyError: a required one
        except FileNotFoundError:
            return None
        except (StateDirError, OSError, ValueError, TypeError, KeyError) as exc:
            log.warning("local_instance_record_unreadable", path=str(path), error=str(exc)[:200])
            return None


def live_records(state_dir: Path) -> list[InstanceRecord]:
    """The records under ``state_dir/nodes/*/`` whose instance still runs (:func:`process_alive`)."""
    nodes = state_dir / "nodes"
    out = []
    try:
        dirs = sorted(p for p in nodes.iterdir() if p.is_dir() and not p.is_symlink())
    except FileNotFoundError:
        return []
    for d in dirs:
        rec = InstanceRecord.read(d / RECORD_FILE)
        if rec is not None and rec.node_id == d.name and process_alive(rec.pid, rec.create_time):
            out.append(rec)
    return out
